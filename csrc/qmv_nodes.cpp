// The quantized products' nodes (qmv_nodes.h).
#include "qmv_nodes.h"

#include <stdexcept>

#include "attention_nodes.h"

namespace edge0 {

// remap (optional): each index's position in the weights (a slot bank's table of expert id -> slot)
void QMV::run(const std::vector<mx::array>& inputs, float* out, int64_t size, int gs, int64_t ratio, bool has_idx,
             bool glu, bool combine, const uint32_t* remap) {
  const auto& x = inputs[0];
  const int64_t D = x.shape(-1), Rx = x.size() / D;
  const size_t nw = glu ? 9 : 3;
  std::vector<float> xt;
  std::vector<uint32_t> it;
  std::vector<QTemps> temps(3);
  std::vector<QWeights> q;
  for (size_t j = 0; j < nw; j += 3) {
    const int64_t Dj = j < 6 ? D : inputs[1].shape(-2);  // down reads the gate/up width
    q.push_back(qweights(inputs[1 + j], inputs[2 + j], inputs[3 + j], Dj, gs, temps[j / 3]));
  }
  const int64_t N = q.back().N, R = has_idx ? inputs[1 + nw].size() : size / N;
  const uint32_t* idx = has_idx ? dense_data<uint32_t>(inputs[1 + nw], it) : nullptr;
  std::vector<Pair> pairs(R);
  for (int64_t o = 0; o < R; o++) pairs[o] = {idx ? (int64_t)(remap ? remap[idx[o]] : idx[o]) : 0, o / ratio, o};
  const float* xd = dense_data<float>(x, xt);
  const bool prompt = spread(Rx);  // token rows: a prompt chunk or a batch's step
  if (!glu) {
    qmv(q[0], xd, Rx, pairs, out, prompt);
    return;
  }
  const int64_t H = q[0].N;
  std::unique_ptr<float[]> gp(new float[R * H]), up(new float[R * H]);  // every value written by qmv: not zeroed
  float *g = gp.get(), *u = up.get();
  qmv(q[0], xd, Rx, pairs, g, prompt);
  qmv(q[1], xd, Rx, pairs, u, prompt);
  swiglu(g, u, R * H);
  for (int64_t o = 0; o < R; o++) pairs[o].xrow = o;
  if (!combine) {
    qmv(q[2], g, R, pairs, out, prompt);
    return;
  }
  std::unique_ptr<float[]> y(new float[R * N]);
  std::vector<float> st;
  qmv(q[2], g, R, pairs, y.get(), prompt);
  const auto& scores = inputs.back();
  const int k = scores.shape(-1);
  edge0::combine(y.get(), dense_data<float>(scores, st), R / k, k, N, out);
}

// The projection of R rows xd of D values; its weights in[w], in[w + 1], in[w + 2][, adapter in[w + 3], in[w + 4]].
void project_rows(const float* xd, int64_t R, int64_t D, const std::vector<mx::array>& in, size_t w,
                  const Projection& p, float* y) {
  QTemps temps;
  const QWeights q = qweights(in[w], in[w + 1], in[w + 2], D, p.group_size, temps);
  std::vector<Pair> pairs(R);
  for (int64_t o = 0; o < R; o++) pairs[o] = {0, o, o};
  qmv(q, xd, R, pairs, y, spread(R));
  if (p.inputs < 6) return;
  adapt_arrays(xd, R, D, in[w + 3], in[w + 4], p.scale, y);
}

// y (R, N) += scale * (xd A) B, A and B arrays (D, r) and (r, N) of float32 or bfloat16: a branch beside a block
void adapt_arrays(const float* xd, int64_t R, int64_t D, const mx::array& a, const mx::array& b, float scale,
                  float* y) {
  const int64_t N = b.shape(-1), r = a.shape(-1);
  if (a.dtype() == mx::bfloat16) {
    std::vector<uint16_t> at, bt;
    adapt(xd, R, D, dense_data<uint16_t>(a, at), dense_data<uint16_t>(b, bt), N, r, scale, y);
  } else {
    std::vector<float> at, bt;
    adapt(xd, R, D, dense_data<float>(a, at), dense_data<float>(b, bt), N, r, scale, y);
  }
}

// in[0] (x) and the weights after it
void project(const std::vector<mx::array>& in, const Projection& p, float* y) {
  std::vector<float> xt;
  const int64_t D = in[0].shape(-1);
  project_rows(dense_data<float>(in[0], xt), in[0].size() / D, D, in, 1, p, y);
}

[[noreturn]] void fail(const std::string& m) { throw std::invalid_argument("edge0 qmv/glu: " + m); }

// w (E, N, D*bits/32) or (N, D*bits/32) uint32 (4 or 8 bits), scales and biases (..., N, D/gs) float32 or
// both bfloat16 -> N
int64_t check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int64_t D,
                      int group_size) {
  if ((w.ndim() != 2 && w.ndim() != 3) || w.dtype() != mx::uint32) fail("w must be (E, N, D*bits/32) uint32");
  if (scales.dtype() != biases.dtype() || (scales.dtype() != mx::float32 && scales.dtype() != mx::bfloat16))
    fail("scales and biases must be both float32 or both bfloat16");
  const int64_t N = w.shape(-2), G = D / group_size;
  if (N < 1 || (w.ndim() == 3 && w.shape(0) < 1)) fail("w must hold at least one expert and one output row");
  if (D < 64 || D % 64 != 0 || D % group_size != 0 || (w.shape(-1) * 8 != D && w.shape(-1) * 4 != D))
    fail("D must be a positive multiple of 64 and of group_size, matching w (4 or 8 bits)");
  if (G > MAX_GROUPS) fail("too many groups");
  if (scales.shape() != biases.shape() || scales.shape(-1) != G || scales.shape(-2) != N ||
      scales.ndim() != w.ndim() || (w.ndim() == 3 && scales.shape(0) != w.shape(0)))
    fail("scales/biases shape does not match w");
  return N;
}

// The output shape: `shape` when given (its size must be R * N), else (R, N).
static mx::Shape out_shape(std::optional<std::vector<int>> shape, int64_t R, int64_t N) {
  if (!shape) return {(int)R, (int)N};
  int64_t n = 1;
  for (int d : *shape) {
    if (d < 0) fail("shape must not have negative dimensions");
    n *= d;
  }
  if (n != R * N || shape->empty() || shape->back() != N) fail("shape must hold R x N outputs, N last");
  return mx::Shape(shape->begin(), shape->end());
}

static std::vector<mx::array> with_idx(std::vector<mx::array> inputs, const std::optional<mx::array>& idx,
                                       mx::Stream s) {
  if (idx && !mx::issubdtype(idx->dtype(), mx::integer)) fail("expert indices must be integers");
  if (idx) inputs.push_back(idx->dtype() == mx::uint32 ? *idx : mx::astype(*idx, mx::uint32, s));
  return inputs;
}

// x (..., D) float32 with Rx rows; idx (R entries) expert per output row, or none (R = Rx, expert 0).
// x (..., D) float32 of at least one row, a supported group size; returns the rows of x.
int64_t check_x(const mx::array& x, int group_size) {
  if (x.ndim() < 1 || x.dtype() != mx::float32) fail("x must be (..., D) float32");
  if (group_size != 32 && group_size != 64 && group_size != 128) fail("group_size must be 32, 64 or 128");
  const int64_t rx = x.shape(-1) ? x.size() / x.shape(-1) : 0;
  if (rx == 0) fail("x must have at least one row");
  return rx;
}

mx::array qmv_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                 std::optional<mx::array> idx, int group_size, std::optional<std::vector<int>> shape) {
  const int64_t rx = check_x(x, group_size);
  const int64_t D = x.shape(-1), N = check_weights(w, scales, biases, D, group_size);
  const int64_t R = idx ? idx->size() : rx;
  if (R % rx != 0) fail("index rows must be a multiple of x rows");
  if (!idx)
    if (auto fused = attention_then(x, {w, scales, biases}, Projection{4, group_size, 0.f}, out_shape(shape, R, N)))
      return *fused;
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(out_shape(shape, R, N), mx::float32, std::make_shared<QMV>(s, group_size, R / rx, (bool)idx, false),
                   with_idx({x, w, scales, biases}, idx, s));
}

// Whether an adapter's lora_a and lora_b are (D, r) and (r, N), r >= 1, both float32 or both bfloat16 (as served:
// half the bytes, widened exactly): a projection from D to N.
bool lora_fits(const mx::array& a, const mx::array& b, int64_t D, int64_t N) {
  return (a.dtype() == mx::float32 || a.dtype() == mx::bfloat16) && b.dtype() == a.dtype() && a.ndim() == 2 &&
         b.ndim() == 2 && a.shape(0) == D &&
         b.shape(1) == N && a.shape(1) == b.shape(0) && a.shape(1) >= 1;
}

mx::array qmv_lora_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                      const mx::array& a, const mx::array& b, float scale, int group_size) {
  const int64_t rx = check_x(x, group_size);
  const int64_t D = x.shape(-1), N = check_weights(w, scales, biases, D, group_size);
  if (w.ndim() != 2) fail("qmv_lora: w must be (N, D*bits/32)");
  if (!lora_fits(a, b, D, N)) fail("qmv_lora: lora_a must be (D, r) and lora_b (r, N), both float32 or both bfloat16");
  auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape shape(x.shape().begin(), x.shape().end());
  shape.back() = (int)N;
  (void)rx;
  if (auto fused = attention_then(x, {w, scales, biases, a, b}, Projection{6, group_size, scale}, shape)) return *fused;
  return mx::array(shape, mx::float32, std::make_shared<QMVLoRA>(s, group_size, scale), {x, w, scales, biases, a, b});
}

// Routed experts' whole products, one node: row o = down(swiglu(gate(x), up(x))) of expert idx[o].
// Routed experts' gate, up, down (w, scales, biases each) for inputs of width D, checked: the down projection's
// width N.
int64_t check_glu(const std::vector<mx::array>& gate, const std::vector<mx::array>& up,
                  const std::vector<mx::array>& down, int64_t D, int group_size) {
  if (gate.size() != 3 || up.size() != 3 || down.size() != 3) fail("gate, up, down are (w, scales, biases)");
  const int64_t H = check_weights(gate[0], gate[1], gate[2], D, group_size);
  if (check_weights(up[0], up[1], up[2], D, group_size) != H) fail("gate and up differ in width");
  const int64_t N = check_weights(down[0], down[1], down[2], H, group_size);
  if (gate[0].ndim() != 3 || up[0].shape() != gate[0].shape() || down[0].shape(0) != gate[0].shape(0))
    fail("gate, up, down must hold the same experts (E, ., .)");
  return N;
}

mx::array glu_op(const mx::array& x, const mx::array& idx, const std::vector<mx::array>& gate,
                 const std::vector<mx::array>& up, const std::vector<mx::array>& down, int group_size,
                 std::optional<std::vector<int>> shape) {
  const int64_t rx = check_x(x, group_size);
  const int64_t N = check_glu(gate, up, down, x.shape(-1), group_size);
  const int64_t R = idx.size();
  if (R % rx != 0) fail("index rows must be a multiple of x rows");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(out_shape(shape, R, N), mx::float32, std::make_shared<QMV>(s, group_size, R / rx, true, true),
                   with_idx({x, gate[0], gate[1], gate[2], up[0], up[1], up[2], down[0], down[1], down[2]}, idx, s));
}

}  // namespace edge0
