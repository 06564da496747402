// Attention's nodes (attention_nodes.h).
#include "attention_nodes.h"

#include <atomic>
#include <stdexcept>
#include <thread>

#include "dense_nodes.h"
#include "qmv_nodes.h"

namespace edge0 {

class AttentionOp : public DenseOp {
 public:
  AttentionOp(mx::Stream s, float scale, bool causal) : DenseOp(s), scale_(scale), causal_(causal) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [scale = scale_, causal = causal_](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<int32_t> st;
      attention(view4(in[0]), view4(in[1]), view4(in[2]), scale, causal, o.data<float>(),
                in.size() > 3 ? dense_data<int32_t>(in[3], st) : nullptr);
    });
  }
  const char* name() const override { return "Edge0Attention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AttentionOp&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

// One new token's attention in a decoder layer, of one sequence or of each of a batch, as three nodes where
// mlx-lm's code builds 17 (its reshapes, transposes, slice updates and slices among them): Edge0KVWrite puts the
// token's k row (RMS-normed per head and rotated) and its v row at row `offset` of the KV cache's buffers
// (B, Hkv, C, Dh); Edge0DecodeAttention norms and rotates the token's q and attends to the buffers' first
// offset + 1 rows. A batch (mlx-lm's left-padded BatchKVCache) writes every sequence's row at the same `offset`,
// rotates each at its own position (`positions`, (B,) int32) and starts each sequence's attention at its own
// first key (`starts`). A buffer that nothing else holds is written in place (its storage passes to the output,
// as MLX's slice update does), else copied first.
// Each step is the function the separate nodes call, so the results are theirs bit for bit.
static std::atomic<int64_t> kv_copies_{0};

// Whether buf can pass its storage on to the node now being evaluated. A step built while the step before it
// computes (overlapped decode) is evaluated here while that step's tasks that read buf may still be queued on the
// stream, holding it until they have run: then wait, until buf is free or until a marker queued behind them has run
// (every task queued before it done). A holder that is no queued task (a prompt cache's copy, a caller's
// reference) still holds it then, and the buffer is copied. Without the wait the cache was copied, whole, at a
// share of the steps that depended on how far ahead the graph-building thread ran.
static bool donatable(const mx::array& buf, mx::Stream s) {
  if (buf.is_donatable()) return true;
  if (!buf.data_shared_ptr() || !buf.data_shared_ptr()->is_owned()) return false;
  auto ran = std::make_shared<std::atomic<bool>>(false);
  mx::cpu::get_command_encoder(s).dispatch([ran] { ran->store(true, std::memory_order_release); });
  for (;;) {
    const bool drained = ran->load(std::memory_order_acquire);  // before the check: its tasks are then gone
    if (buf.is_donatable()) return true;
    if (drained) return false;
    std::this_thread::yield();
  }
}

// B sequences' heads of Dh values, contiguous: RMS-normed (w given) then rotated (dims > 0) at `offset`, or at
// positions[b] for sequence b, into out.
static void norm_rotate(const float* x, const float* w, float eps, int64_t B, int64_t heads, int64_t Dh, int dims,
                        bool trad, float base, float scale, int64_t offset, const int32_t* positions, float* out) {
  std::vector<float> n;
  const float* src = x;
  if (w) {
    n.resize(B * heads * Dh);
    rms_norm(x, w, eps, B * heads, Dh, n.data());
    src = n.data();
  }
  if (dims > 0)
    rope(View4{src, {B, heads, 1, Dh}, {heads * Dh, Dh, Dh, 1}}, dims, trad, base, scale, offset, out, positions);
  else if (src != out)
    std::copy(src, src + B * heads * Dh, out);
}

struct Rotation {
  bool norm, positions;  // inputs: a norm weight; per-sequence positions (else every sequence at offset)
  float eps;
  int dims;  // 0: no rotation
  bool traditional;
  float base, scale;
  bool operator==(const Rotation& o) const {
    return norm == o.norm && positions == o.positions && eps == o.eps && dims == o.dims &&
           traditional == o.traditional && base == o.base && scale == o.scale;
  }
};

// The n values the KV write or the attention starts from: input 0, or the output of the projection leading the
// inputs (Projection), run here into t. next: the index of the first input after them.
static const float* rows_input(const std::vector<mx::array>& in, const Projection& p, int64_t n, std::vector<float>& t,
                               size_t& next) {
  next = p.inputs ? p.inputs : 1;
  if (!p.inputs) return dense_data<float>(in[0], t);
  t.resize(n);
  project(in, p, t.data());
  return t.data();
}

// Writes the new rows of a KV write (inputs: the rows, or the projection making them[, norm][, positions], buffer)
// into dst, the buffer's storage or a fresh one (copy: the buffer's values copied into it first).
static void write_rows(const std::vector<mx::array>& in, bool copy, float* dst, int64_t offset, const Rotation& r,
                       const Projection& p) {
  const auto& buf = in.back();
  const int64_t B = buf.shape(0), H = buf.shape(1), C = buf.shape(2), Dh = buf.shape(3);
  if (copy) {
    std::vector<float> t;
    const float* src = dense_data<float>(buf, t);
    std::copy(src, src + buf.size(), dst);
  }
  std::vector<float> xt, wt, row(B * H * Dh);
  std::vector<int32_t> pt;
  size_t at;  // in[at]: the first input after the rows
  const float* x = rows_input(in, p, B * H * Dh, xt, at);
  norm_rotate(x, r.norm ? dense_data<float>(in[at], wt) : nullptr, r.eps, B, H, Dh, r.dims, r.traditional, r.base,
              r.scale, offset, r.positions ? dense_data<int32_t>(in[at + r.norm], pt) : nullptr, row.data());
  for (int64_t bh = 0; bh < B * H; bh++)
    std::copy(row.data() + bh * Dh, row.data() + (bh + 1) * Dh, dst + (bh * C + offset) * Dh);
}

// out takes buf's storage where buf can pass it on, else fresh storage; whether buf must be copied into it.
static bool take_buffer(const mx::array& buf, mx::array& out, mx::Stream s) {
  if (buf.flags().row_contiguous && buf.data_size() == buf.size() && donatable(buf, s)) {
    out.copy_shared_buffer(buf);
    return false;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  kv_copies_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Inputs: x (B*Hkv*Dh values)[, norm (Dh,)][, positions (B,)], buffer (B, Hkv, C, Dh); output: the buffer with
// row offset of every sequence written.
class KVWriteOp : public DenseOp {
 public:
  KVWriteOp(mx::Stream s, int64_t offset, Rotation r, Projection p) : DenseOp(s), offset_(offset), r_(r), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const bool copy = take_buffer(inputs.back(), out, stream());
    run(inputs, out, [copy, offset = offset_, r = r_, p = p_](const std::vector<mx::array>& in, mx::array& o) {
      write_rows(in, copy, o.data<float>(), offset, r, p);
    });
  }
  const char* name() const override { return "Edge0KVWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const KVWriteOp&>(other);
    return offset_ == o.offset_ && r_ == o.r_ && p_ == o.p_;
  }

 private:
  int64_t offset_;
  Rotation r_;
  Projection p_;
};

// A layer's two KV writes, the keys' then the values' (each the function of its Edge0KVWrite), for a node that runs
// them: its inputs start with the keys write's (the last of them the keys buffer, `nk` in all), then the values'.
struct KVPair {
  int64_t offset;
  size_t nk;
  Rotation rk;
  Projection pk, pv;

  // the keys' rows into keys, the values' into values (each buffer copied in first where it could not pass its
  // storage on)
  auto writer() const {
    return [offset = offset, nk = nk, rk = rk, pk = pk, pv = pv](const std::vector<mx::array>& in, bool ck, bool cv,
                                                                 float* keys, float* values) {
      write_rows({in.begin(), in.begin() + nk}, ck, keys, offset, rk, pk);
      write_rows({in.begin() + nk, in.end()}, cv, values, offset, Rotation{}, pv);
    };
  }
  bool operator==(const KVPair& o) const {
    return offset == o.offset && nk == o.nk && rk == o.rk && pk == o.pk && pv == o.pv;
  }
};

// A layer's attention block for a new token, as one node: the two KV writes (KVPair), then the
// add-norm that runs the attention and its output projection (AddRMSNormOp's work, on the buffers just written), so
// the bits of those two nodes. Inputs: the pair's (`np`), then the add-norm's without the two buffers it reads
// (which stood at `at` and `at + 1`); outputs: h + attention, its norm, the keys and values buffers.
class AttentionBlockOp : public MultiOp {
 public:
  AttentionBlockOp(mx::Stream s, KVPair pair, size_t np, float eps, Absorbed attention, size_t at)
      : MultiOp(s), pair_(pair), np_(np), eps_(eps), attention_(std::move(attention)), at_(at) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // Each output of a node keeps its own list of the node's inputs (mx::array::make_arrays), so a buffer is held
    // once a list and never donatable: the other outputs' lists go now (MLX clears them all once the node is
    // evaluated), so that the cache's buffers can pass on.
    for (auto& o : outputs)
      if (&o.inputs() != &inputs) o.inputs().clear();
    const bool ck = take_buffer(inputs[held_.seen_at(pair_.nk - 1)], outputs[2], stream());
    const bool cv = take_buffer(inputs[held_.seen_at(np_ - 1)], outputs[3], stream());
    for (size_t i : {size_t(0), size_t(1)}) outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) enc.set_output_array(o);
    enc.dispatch([inputs = held_.all(inputs), outputs, ck, cv, write = pair_.writer(), np = np_, eps = eps_,
                  rn = attention_,
                  at = at_]() mutable {
      ProfileScope scope([] { return std::string("Edge0AttentionBlock"); });
      write({inputs.begin(), inputs.begin() + np}, ck, cv, outputs[2].data<float>(), outputs[3].data<float>());
      std::vector<mx::array> in(inputs.begin() + np, inputs.end());
      in.insert(in.begin() + at, {outputs[2], outputs[3]});
      AddRMSNormOp::run(in, outputs[0].data<float>(), outputs[1].data<float>(), outputs[0].size(),
                        outputs[0].shape(-1), eps, rn);
    });
  }
  const char* name() const override { return "Edge0AttentionBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AttentionBlockOp&>(other);
    return np_ == o.np_ && at_ == o.at_ && pair_ == o.pair_ && eps_ == o.eps_ && attention_ == o.attention_ &&
           held_ == o.held_;
  }

 private:
  KVPair pair_;
  size_t np_;
  float eps_;  // the add-norm's
  Absorbed attention_;  // the attention with its output projection, which the add-norm runs
  size_t at_;
};

// Inputs: q (B*heads*Dh values)[, norm (Dh,)][, positions (B,)][, starts (B,)], keys, values (B, Hkv, C, Dh);
// output (B, 1, heads*Dh): the heads side by side, as the output projection takes them.
class DecodeAttentionOp : public DenseOp, public Computes {
 public:
  DecodeAttentionOp(mx::Stream s, int64_t offset, Rotation r, bool starts, float scale, Projection p,
                    Projection out = {})
      : DenseOp(s), offset_(offset), r_(r), starts_(starts), scale_(scale), p_(p), out_(out) {}

  // the node's work on its inputs, into o
  auto function() const {
    return [offset = offset_, r = r_, starts = starts_, scale = scale_, p = p_, op = out_](
                  const std::vector<mx::array>& in, float* o) {
      const size_t kv = in.size() - 2 - (op.inputs ? op.inputs - 1 : 0);  // keys, values; the out projection's weights
      const auto& keys = in[kv];
      const auto& values = in[kv + 1];
      const int64_t B = keys.shape(0), Hkv = keys.shape(1), C = keys.shape(2), Dh = keys.shape(3);
      size_t first;
      std::vector<float> xt, wt, kt, vt;
      const int64_t Hq = p.inputs ? in[1].shape(-2) / Dh : in[0].size() / (B * Dh);  // the q rows' heads
      std::vector<float> qr(B * Hq * Dh), heads(op.inputs ? B * Hq * Dh : 0);
      std::vector<int32_t> pt, st;
      const float* x = rows_input(in, p, B * Hq * Dh, xt, first);
      const size_t at = first + r.norm;  // the first integer input
      norm_rotate(x, r.norm ? dense_data<float>(in[first], wt) : nullptr, r.eps, B, Hq, Dh, r.dims,
                  r.traditional, r.base, r.scale, offset, r.positions ? dense_data<int32_t>(in[at], pt) : nullptr,
                  qr.data());
      const float* kc = dense_data<float>(keys, kt);  // the KV writes' outputs: contiguous
      const float* vc = dense_data<float>(values, vt);
      const int64_t S = offset + 1;
      attention(View4{qr.data(), {B, Hq, 1, Dh}, {Hq * Dh, Dh, Dh, 1}},
                View4{kc, {B, Hkv, S, Dh}, {Hkv * C * Dh, C * Dh, Dh, 1}},
                View4{vc, {B, Hkv, S, Dh}, {Hkv * C * Dh, C * Dh, Dh, 1}}, scale, false,
                op.inputs ? heads.data() : o, starts ? dense_data<int32_t>(in[at + r.positions], st) : nullptr);
      if (op.inputs) project_rows(heads.data(), B, Hq * Dh, in, kv + 2, op, o);
    };
  }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [fn = function()](const std::vector<mx::array>& in, mx::array& o) { fn(in, o.data<float>()); });
  }
  void compute(const std::vector<mx::array>& in, float* out, int64_t) const override { function()(in, out); }
  const char* name() const override { return "Edge0DecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const DecodeAttentionOp&>(other);
    return offset_ == o.offset_ && r_ == o.r_ && starts_ == o.starts_ && scale_ == o.scale_ && p_ == o.p_ &&
           out_ == o.out_;
  }
  // this node with the projection of its output run inside it as well
  std::shared_ptr<DecodeAttentionOp> then(const Projection& out) {
    return out_.inputs ? nullptr : std::make_shared<DecodeAttentionOp>(stream(), offset_, r_, starts_, scale_, p_, out);
  }

 private:
  int64_t offset_;
  Rotation r_;
  bool starts_;
  float scale_;
  Projection p_, out_;  // the q projection run first; the output projection run last
};

std::optional<mx::array> attention_then(const mx::array& x, const std::vector<mx::array>& weights,
                                        const Projection& p, const mx::Shape& shape) {
  auto* att = x.status() == mx::array::Status::unscheduled ? dynamic_cast<DecodeAttentionOp*>(&x.primitive()) : nullptr;
  auto fused = att ? att->then(p) : nullptr;
  if (!fused) return std::nullopt;
  auto in = whole_inputs(x);
  in.insert(in.end(), weights.begin(), weights.end());
  return mx::array(shape, mx::float32, fused, std::move(in));
}

// B sequences' rows of a decode token (heads of Dh values each), their optional norm weight and per-sequence
// positions, checked; returns the inputs so far.
static std::vector<mx::array> head_rows(const char* op, const mx::array& x, const std::optional<mx::array>& norm,
                                        const std::optional<mx::array>& positions, int64_t B, int64_t heads,
                                        int64_t Dh, int dims) {
  need_f32(x, op, "the rows");
  if (heads < 1 || Dh < 1 || x.size() != B * heads * Dh || dims < 0 || dims % 2 || dims > Dh)
    throw std::invalid_argument(std::string("edge0 ") + op + ": " + std::to_string(B) + " x " +
                                std::to_string(heads) + " heads of " + std::to_string(Dh) +
                                " values expected, and rope dims even, at most Dh (0: none)");
  std::vector<mx::array> in{x};
  if (norm) {
    need_f32(*norm, op, "the norm weight");
    if (norm->ndim() != 1 || norm->shape(0) != Dh)
      throw std::invalid_argument(std::string("edge0 ") + op + ": norm weight (Dh,)");
    in.push_back(*norm);
  }
  need_rows(positions, B, op, "positions");
  if (positions) in.push_back(*positions);
  return in;
}

// x's projection when x is a plain projection node not yet evaluated (Projection: the node taking x runs it, one
// node fewer); none (inputs 0) otherwise. absorb puts its inputs in x's place.
static Projection absorbable(const mx::array& x) {
  if (x.status() != mx::array::Status::unscheduled) return {};
  if (auto* p = dynamic_cast<QMVLoRA*>(&x.primitive())) return p->projection();
  if (auto* p = dynamic_cast<QMV*>(&x.primitive())) return p->projection();
  return {};
}

static void absorb(std::vector<mx::array>& in, const mx::array& x, const Projection& p) {
  if (!p.inputs) return;
  const auto xin = whole_inputs(x);
  in.erase(in.begin());
  in.insert(in.begin(), xin.begin(), xin.end());
}

static bool is_cache_buffer(const mx::array& b) { return b.ndim() == 4 && b.shape(0) >= 1 && b.dtype() == mx::float32; }

mx::array kv_write_op(const mx::array& x, const std::optional<mx::array>& norm, const mx::array& buffer,
                      int64_t offset, float eps, int dims, bool traditional, float base, float rope_scale,
                      const std::optional<mx::array>& positions) {
  if (!is_cache_buffer(buffer) || offset < 0 || offset >= buffer.shape(2))
    throw std::invalid_argument("edge0 kv_write: buffer (B, H, C, Dh) float32 and 0 <= offset < C");
  auto in = head_rows("kv_write", x, norm, positions, buffer.shape(0), buffer.shape(1), buffer.shape(3), dims);
  in.push_back(buffer);
  const Projection p = absorbable(x);
  absorb(in, x, p);
  auto s = mx::default_stream(mx::Device::cpu);
  const Rotation r{(bool)norm, (bool)positions, eps, dims, traditional, base, rope_scale};
  return mx::array(buffer.shape(), mx::float32, std::make_shared<KVWriteOp>(s, offset, r, p), in);
}

mx::array decode_attention_op(const mx::array& q, const std::optional<mx::array>& norm, const mx::array& keys,
                              const mx::array& values, int64_t offset, float eps, int dims, bool traditional,
                              float base, float rope_scale, float scale,
                              const std::optional<mx::array>& positions,
                              const std::optional<mx::array>& starts) {
  const int64_t B = keys.ndim() == 4 ? keys.shape(0) : 1, Dh = keys.ndim() == 4 ? keys.shape(3) : 1;
  if (!is_cache_buffer(keys) || keys.shape() != values.shape() || values.dtype() != mx::float32 || offset < 0 ||
      offset >= keys.shape(2) || Dh < 1 || q.size() % (B * Dh) || (q.size() / (B * Dh)) % keys.shape(1))
    throw std::invalid_argument(
        "edge0 decode_attention: keys and values (B, Hkv, C, Dh) float32, 0 <= offset < C, q B x a multiple of Hkv "
        "heads of Dh");
  const int64_t heads = q.size() / (B * Dh);
  auto in = head_rows("decode_attention", q, norm, positions, B, heads, Dh, dims);
  need_rows(starts, B, "decode_attention", "starts");
  if (starts) in.push_back(*starts);
  in.push_back(keys);
  in.push_back(values);
  const Projection p = absorbable(q);
  absorb(in, q, p);
  auto s = mx::default_stream(mx::Device::cpu);
  const Rotation r{(bool)norm, (bool)positions, eps, dims, traditional, base, rope_scale};
  return mx::array(mx::Shape{(int)B, 1, (int)(heads * Dh)}, mx::float32,
                   std::make_shared<DecodeAttentionOp>(s, offset, r, (bool)starts, scale, p), in);
}

// One new token's whole attention block for one sequence (or a left-padded batch: positions, each sequence's
// rotation offset, and starts, its first key, as decode_attention takes them): its k, v and q projections, the two
// KV writes, the attention, the output projection and the residual add with the RMS norm after it, as one node
// (AttentionBlockOp) with the bits of the nodes decode_attention and add_norm of compute/dense.py build, from one
// call instead of seven (each call from Python costs microseconds). Returns (h + attention, its norm, the keys
// buffer, the values buffer).
std::vector<mx::array> attention_block_op(const mx::array& x, const mx::array& h,
                                          const std::vector<mx::array>& q, const std::vector<mx::array>& k,
                                          const std::vector<mx::array>& v, const std::vector<mx::array>& o,
                                          float lora_scale, int group_size, const mx::array& q_norm,
                                          float q_eps, const mx::array& k_norm, float k_eps,
                                          const mx::array& keys, const mx::array& values, int64_t offset,
                                          int dims, bool traditional, float base, float rope_scale, float scale,
                                          const mx::array& post_norm, float post_eps,
                                          const std::optional<mx::array>& positions,
                                          const std::optional<mx::array>& starts) {
  // The node's inputs are laid out as the nodes kv_write_op, decode_attention_op, the output projection and
  // add_rms_norm_op would build them (their projections absorbed), checked as they check them.
  auto bad = [](const std::string& what) { throw std::invalid_argument("edge0 attention_block: " + what); };
  const int64_t rows = check_x(x, group_size), D = x.shape(-1);
  auto proj = [&](const std::vector<mx::array>& p, int64_t width, const char* name) {
    if (p.size() != 3 && p.size() != 5) bad(std::string(name) + " is (w, scales, biases[, lora_a, lora_b])");
    const int64_t N = check_weights(p[0], p[1], p[2], width, group_size);
    if (p[0].ndim() != 2) bad(std::string(name) + ": w must be (N, D*bits/32)");
    if (p.size() == 5 && !lora_fits(p[3], p[4], width, N))
      bad(std::string(name) + ": lora_a must be (D, r) and lora_b (r, N), both float32 or both bfloat16");
    return std::make_pair(Projection{(int)p.size() + 1, group_size, p.size() == 5 ? lora_scale : 0.f}, N);
  };
  const auto [pq, Nq] = proj(q, D, "q");
  const auto [pk, Nk] = proj(k, D, "k");
  const auto [pv, Nv] = proj(v, D, "v");
  const auto [po, No] = proj(o, Nq, "o");
  if (!is_cache_buffer(keys) || keys.shape() != values.shape() || values.dtype() != mx::float32 || offset < 0 ||
      offset >= keys.shape(2))
    bad("keys and values (B, Hkv, C, Dh) float32, 0 <= offset < C");
  const int64_t B = keys.shape(0), Hkv = keys.shape(1), Dh = keys.shape(3);
  if (rows != B || Nk != Hkv * Dh || Nv != Hkv * Dh || Nq % (Hkv * Dh) != 0)
    bad("x a row per sequence, k and v projections to Hkv heads of Dh, q to a multiple of them");
  if (dims < 0 || dims % 2 || dims > Dh) bad("rope dims even, at most Dh (0: none)");
  for (auto* n : {&q_norm, &k_norm})
    if (n->dtype() != mx::float32 || n->ndim() != 1 || n->shape(0) != Dh) bad("q and k norm weights (Dh,) float32");
  need_rows(positions, B, "attention_block", "positions");
  need_rows(starts, B, "attention_block", "starts");
  need_f32(h, "attention_block", "h");
  need_f32(post_norm, "attention_block", "the norm weight");
  if (h.shape() != mx::Shape{(int)B, 1, (int)No} || post_norm.ndim() != 1 || post_norm.shape(0) != No)
    bad("h (B, 1, N) of the o projection's width N, the norm weight (N,)");
  auto s = mx::default_stream(mx::Device::cpu);
  // the KV pair: the keys' write (x, k..., k_norm[, positions], keys), then the values' (x, v..., values)
  std::vector<mx::array> in{x};
  in.insert(in.end(), k.begin(), k.end());
  in.push_back(k_norm);
  if (positions) in.push_back(*positions);
  in.push_back(keys);
  const size_t nk = in.size();
  in.push_back(x);
  in.insert(in.end(), v.begin(), v.end());
  in.push_back(values);
  const size_t np = in.size();
  // the add-norm running the attention: (x, q..., q_norm[, positions][, starts], <keys, values>, o...), h, post_norm
  const size_t first = in.size();
  in.push_back(x);
  in.insert(in.end(), q.begin(), q.end());
  in.push_back(q_norm);
  if (positions) in.push_back(*positions);
  if (starts) in.push_back(*starts);
  const size_t at = in.size() - first;
  in.insert(in.end(), o.begin(), o.end());
  const int attention_inputs = (int)(in.size() - first + 2);
  in.push_back(h);
  in.push_back(post_norm);
  const Rotation rk{true, (bool)positions, k_eps, dims, traditional, base, rope_scale};
  const Rotation rq{true, (bool)positions, q_eps, dims, traditional, base, rope_scale};
  auto attention = std::make_shared<DecodeAttentionOp>(s, offset, rq, (bool)starts, scale, pq, po);
  const KVPair pair{offset, nk, rk, pk, pv};
  auto op = std::make_shared<AttentionBlockOp>(s, pair, np, post_eps, Absorbed{attention, attention_inputs}, at);
  op->hold(in, {nk - 1, np - 1});  // the weights; the cache's buffers stay shown, to pass on to the outputs
  return mx::array::make_arrays(
      {h.shape(), h.shape(), keys.shape(), values.shape()}, {mx::float32, mx::float32, mx::float32, mx::float32},
      std::move(op), std::move(in));
}

mx::array attention_op(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                       const std::optional<mx::array>& starts) {
  for (auto* a : {&q, &k, &v}) need_f32(*a, "attention", "q, k and v");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k.shape() != v.shape() || q.shape(0) != k.shape(0) ||
      q.shape(3) != k.shape(3) || k.shape(1) == 0 || q.shape(1) % k.shape(1) || k.shape(2) == 0 ||
      q.shape(2) > k.shape(2))
    throw std::invalid_argument(
        "edge0 attention: q (B, Hq, L, Dh), k and v (B, Hkv, S, Dh), S >= L, Hq a multiple of Hkv");
  need_rows(starts, q.shape(0), "attention", "starts");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> in{q, k, v};
  if (starts) in.push_back(*starts);
  return mx::array(q.shape(), mx::float32, std::make_shared<AttentionOp>(s, scale, causal), in);
}

int64_t kv_copies() { return kv_copies_.load(); }

}  // namespace edge0
