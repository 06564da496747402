// The dense ops' nodes (dense_nodes.h).
#include "dense_nodes.h"

#include <stdexcept>

namespace edge0 {

class RMSNormOp : public DenseOp {
 public:
  RMSNormOp(mx::Stream s, float eps) : DenseOp(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [eps = eps_](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<float> xt, wt;
      const int64_t D = in[0].shape(-1);
      rms_norm(dense_data<float>(in[0], xt), dense_data<float>(in[1], wt), eps, in[0].size() / D, D,
               o.data<float>());
    });
  }
  const char* name() const override { return "Edge0RMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNormOp&>(other).eps_ && held_ == static_cast<const RMSNormOp&>(other).held_;
  }

 private:
  float eps_;
};

class LogSoftmaxOp : public DenseOp {
 public:
  using DenseOp::DenseOp;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<float> xt;
      const int64_t D = in[0].shape(-1);
      log_softmax(dense_data<float>(in[0], xt), in[0].size() / D, D, o.data<float>());
    });
  }
  const char* name() const override { return "Edge0LogSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

class RoPEOp : public DenseOp {
 public:
  RoPEOp(mx::Stream s, int dims, bool traditional, float base, float scale, int64_t offset)
      : DenseOp(s), dims_(dims), traditional_(traditional), base_(base), scale_(scale), offset_(offset) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [dims = dims_, trad = traditional_, base = base_, scale = scale_, offset = offset_](
                              const std::vector<mx::array>& in, mx::array& o) {
      std::vector<int32_t> ot;
      rope(view4(in[0]), dims, trad, base, scale, offset, o.data<float>(),
           in.size() > 1 ? dense_data<int32_t>(in[1], ot) : nullptr);
    });
  }
  const char* name() const override { return "Edge0RoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RoPEOp&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_ &&
           offset_ == o.offset_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  int64_t offset_;
};

class LinearOp : public DenseOp {
 public:
  LinearOp(mx::Stream s, bool bias) : DenseOp(s), bias_(bias) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [bias = bias_](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<float> xt, wt, bt;
      std::vector<uint16_t> w16;
      const int64_t D = in[0].shape(-1), N = in[1].shape(0);
      const float* x = dense_data<float>(in[0], xt);
      const float* b = bias ? dense_data<float>(in[2], bt) : nullptr;
      if (in[1].dtype() == mx::bfloat16)
        linear(x, in[0].size() / D, dense_data<uint16_t>(in[1], w16), b, N, D, o.data<float>());
      else
        linear(x, in[0].size() / D, dense_data<float>(in[1], wt), b, N, D, o.data<float>());
    });
  }
  const char* name() const override { return "Edge0Linear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return bias_ == static_cast<const LinearOp&>(other).bias_;
  }

 private:
  bool bias_;
};

class HeadOp : public DenseOp, public Computes {
 public:
  HeadOp(mx::Stream s, bool prev, Absorbed router = {})
      : DenseOp(s), prev_(prev), router_(std::move(router)), name_(router_.name("Edge0Head")) {}

  // the head on its inputs, into o (rows of N logits)
  auto function() const {
    return [prev = prev_, rn = router_](const std::vector<mx::array>& in, float* o, int64_t N) {
      // in: x, now, [prev], router, delta, w1, b1, w2, b2; the router's product's inputs first, and no router,
      // where that product runs here
      const size_t b = rn.from ? rn.inputs : 0, p = prev ? 1 : 0, at = b + 2 + p, w = at + (rn.from ? 0 : 1);
      std::vector<float> xt, rt, dt, w1t, b1t, w2t, b2t;
      std::vector<uint16_t> d16, w116, w216;
      std::vector<uint32_t> nt, pt;
      const int64_t D = in[b].shape(-1), k = in[b + 1].shape(-1), H = in[w + 1].shape(0);
      const int64_t E = (in[w].shape(1) - D) / 2, T = in[b].size() / D;
      const float* x = dense_data<float>(in[b], xt);
      const uint32_t* now = dense_data<uint32_t>(in[b + 1], nt);
      const uint32_t* before = prev ? dense_data<uint32_t>(in[b + 2], pt) : nullptr;
      const float* router = rn.values(in, at, T * N, rt);
      const float* b1 = dense_data<float>(in[w + 2], b1t);
      const float* b2 = dense_data<float>(in[w + 4], b2t);
      if (in[w].dtype() == mx::bfloat16)  // all three weight matrices (head_op checks)
        head(x, now, before, T, (int)k, D, E, router, dense_data<uint16_t>(in[w], d16),
             dense_data<uint16_t>(in[w + 1], w116), b1, H, dense_data<uint16_t>(in[w + 3], w216), b2, N, o);
      else
        head(x, now, before, T, (int)k, D, E, router, dense_data<float>(in[w], dt), dense_data<float>(in[w + 1], w1t),
             b1, H, dense_data<float>(in[w + 3], w2t), b2, N, o);
    };
  }
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [fn = function()](const std::vector<mx::array>& in, mx::array& o) {
      fn(in, o.data<float>(), o.shape(-1));
    });
  }
  // (a SoftmaxTopK node deciding from the head's logits runs the head inside it)
  void compute(const std::vector<mx::array>& in, float* out, int64_t size) const override {
    const size_t b = router_.from ? router_.inputs : 0;
    function()(in, out, size / (in[b].size() / in[b].shape(-1)));
  }
  const char* name() const override { return name_; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const HeadOp&>(other);
    return prev_ == o.prev_ && router_ == o.router_ && held_ == o.held_;
  }

 private:
  bool prev_;
  Absorbed router_;  // the router's product, run here
  const char* name_;
};

// An integer array's values as int64, in row-major order.
template <typename T>
static std::vector<int64_t> widened(const mx::array& a) {
  std::vector<T> tmp;
  const T* p = dense_data<T>(a, tmp);
  return std::vector<int64_t>(p, p + a.size());
}

// Rows of a quantized embedding table, one node (MLX composes mx.dequantize of a gathered row from about 30).
class EmbedOp : public DenseOp {
 public:
  EmbedOp(mx::Stream s, int group_size, int bits) : DenseOp(s), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [gs = group_size_, bits = bits_](const std::vector<mx::array>& in, mx::array& o) {
      const std::vector<int64_t> ids = in[0].dtype() == mx::uint32 ? widened<uint32_t>(in[0]) : widened<int32_t>(in[0]);
      std::vector<uint32_t> wt;
      std::vector<float> st, bt;
      const int64_t D = o.shape(-1);
      embed(ids.data(), (int64_t)ids.size(), dense_data<uint32_t>(in[1], wt), dense_data<float>(in[2], st),
            dense_data<float>(in[3], bt), in[1].shape(0), D, gs, bits, o.data<float>());
    });
  }
  const char* name() const override { return "Edge0Embed"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const EmbedOp&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && held_ == o.held_;
  }

 private:
  int group_size_, bits_;
};

// A decode step's log-probabilities as one node: log_softmax (LogSoftmaxOp's function) of each row of x (B, 1, V),
// the step's logits, computed here where they are the LM head's product not yet evaluated (Absorbed); outputs (B, V)
// and the first row again as (V,) (what one sequence's step returns): no slice or squeeze node beside it.
class StepLogSoftmaxOp : public MultiOp {
 public:
  StepLogSoftmaxOp(mx::Stream s, Absorbed x) : MultiOp(s), x_(std::move(x)), name_(x_.name("Edge0LogSoftmax")) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(inputs, outputs, [xn = x_](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      const int64_t V = out[0].shape(-1), B = out[0].size() / V;
      std::vector<float> t;
      float* lp = out[0].data<float>();
      log_softmax(xn.values(in, 0, B * V, t), B, V, lp);
      std::copy(lp, lp + V, out[1].data<float>());
    });
  }
  const char* name() const override { return name_; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const StepLogSoftmaxOp&>(other);
    return x_ == o.x_ && held_ == o.held_;
  }

 private:
  Absorbed x_;  // the LM head's product, run here
  const char* name_;
};

// exp or erf of every element as the kernels compute them, evaluated here (not a graph node): the tests compare
// them bit for bit with mx.exp and mx.erf.
mx::array math_op(mx::array x, const std::string& fn) {
  need_f32(x, "math", "x");
  if (fn != "exp" && fn != "erf") throw std::invalid_argument("edge0 math: fn must be \"exp\" or \"erf\"");
  x = mx::contiguous(x);
  x.eval();
  std::vector<float> y(x.size());
  (fn == "exp" ? exp_mlx : erf_mlx)(x.data<float>(), y.data(), (int64_t)x.size());
  return mx::array(y.begin(), x.shape(), mx::float32);
}

mx::array rms_norm_op(const mx::array& x, const mx::array& w, float eps) {
  need_f32(x, "rms_norm", "x");
  need_f32(w, "rms_norm", "weight");
  if (x.ndim() < 1 || x.shape(-1) < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("edge0 rms_norm: weight must be (D,) for x (..., D), D >= 1");
  auto s = mx::default_stream(mx::Device::cpu);
  return held_node(x.shape(), mx::float32, std::make_shared<RMSNormOp>(s, eps), {x, w});
}

mx::array log_softmax_op(const mx::array& x) {
  need_f32(x, "log_softmax", "x");
  if (x.ndim() < 1 || x.shape(-1) < 1) throw std::invalid_argument("edge0 log_softmax: x (..., D), D >= 1");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<LogSoftmaxOp>(s), {x});
}

std::vector<mx::array> step_log_softmax_op(const mx::array& x) {
  need_f32(x, "step_log_softmax", "x");
  if (x.ndim() != 3 || x.shape(1) != 1 || x.shape(0) < 1 || x.shape(2) < 1)
    throw std::invalid_argument("edge0 step_log_softmax: x (B, 1, V), a step's logits");
  auto s = mx::default_stream(mx::Device::cpu);
  const Absorbed from = absorbable_node(x);  // the LM head's product runs inside this node
  return held_nodes({{x.shape(0), x.shape(2)}, {x.shape(2)}}, {mx::float32, mx::float32},
                    std::make_shared<StepLogSoftmaxOp>(s, from), leading(x, from));
}

std::vector<mx::array> add_rms_norm_op(const mx::array& x, const mx::array& r, const mx::array& w, float eps) {
  need_f32(x, "add_rms_norm", "x");
  need_f32(r, "add_rms_norm", "r");
  need_f32(w, "add_rms_norm", "weight");
  if (x.shape() != r.shape() || x.ndim() < 1 || x.shape(-1) < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("edge0 add_rms_norm: x and r of one shape (..., D), weight (D,), D >= 1");
  auto s = mx::default_stream(mx::Device::cpu);
  const Absorbed from = absorbable_node(r);  // r's node runs inside this one
  std::vector<mx::array> in = from.from ? leading(r, from) : std::vector<mx::array>{x, r};
  if (from.from) in.push_back(x);
  in.push_back(w);
  return mx::array::make_arrays({x.shape(), x.shape()}, {mx::float32, mx::float32},
                                std::make_shared<AddRMSNormOp>(s, eps, from), std::move(in));
}

mx::array linear_op(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  need_f32(x, "linear", "x");
  if (w.dtype() != mx::bfloat16) need_f32(w, "linear", "weight (or bfloat16)");
  if (bias) need_f32(*bias, "linear", "bias");
  if (x.ndim() < 1 || x.shape(-1) < 1 || w.ndim() != 2 || w.shape(1) != x.shape(-1) ||
      (bias && (bias->ndim() != 1 || bias->shape(0) != w.shape(0))))
    throw std::invalid_argument("edge0 linear: weight must be (N, D) and bias (N,) for x (..., D), D >= 1");
  auto shape = x.shape();
  shape.back() = w.shape(0);
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> in{x, w};
  if (bias) in.push_back(*bias);
  return mx::array(shape, mx::float32, std::make_shared<LinearOp>(s, (bool)bias), in);
}

mx::array head_op(const mx::array& x, const mx::array& now, const std::optional<mx::array>& prev,
                  const mx::array& router, const mx::array& delta, const mx::array& w1, const mx::array& b1,
                  const mx::array& w2, const mx::array& b2) {
  for (auto* a : {&x, &router, &b1, &b2}) need_f32(*a, "head", "x, router and the biases");
  for (auto* a : {&delta, &w2})
    if (a->dtype() != w1.dtype() || (w1.dtype() != mx::float32 && w1.dtype() != mx::bfloat16))
      throw std::invalid_argument("edge0 head: delta, w1 and w2 must be all float32 or all bfloat16");
  const bool ok_ids = now.dtype() == mx::uint32 && (!prev || (prev->dtype() == mx::uint32 && prev->shape() == now.shape()));
  const int64_t D = x.ndim() ? x.shape(-1) : 0, N = router.ndim() ? router.shape(-1) : 0;
  const int64_t rows = D ? x.size() / D : 0;
  if (!ok_ids || x.ndim() < 1 || D < 1 || now.ndim() < 1 || now.shape(-1) < 1 || now.size() / now.shape(-1) != rows ||
      router.size() != rows * N || delta.ndim() != 2 || delta.shape(0) != N || delta.shape(1) <= D ||
      (delta.shape(1) - D) % 2 || w1.ndim() != 2 || w1.shape(1) != delta.shape(1) || b1.ndim() != 1 ||
      b1.shape(0) != w1.shape(0) || w2.ndim() != 2 || w2.shape(0) != N || w2.shape(1) != w1.shape(0) ||
      b2.ndim() != 1 || b2.shape(0) != N)
    throw std::invalid_argument(
        "edge0 head: x (..., D), now and prev (..., k) uint32, router (..., N), delta (N, D + 2E), w1 (H, D + 2E), "
        "b1 (H,), w2 (N, H), b2 (N,)");
  auto s = mx::default_stream(mx::Device::cpu);
  const Absorbed from = absorbable_node(router);  // the router's product runs inside this node
  std::vector<mx::array> in = from.from ? whole_inputs(router) : std::vector<mx::array>{};
  in.push_back(x);
  in.push_back(now);
  if (prev) in.push_back(*prev);
  if (!from.from) in.push_back(router);
  for (auto* a : {&delta, &w1, &b1, &w2, &b2}) in.push_back(*a);
  return held_node(router.shape(), mx::float32, std::make_shared<HeadOp>(s, (bool)prev, from), std::move(in));
}

mx::array embed_op(const mx::array& ids, const mx::array& w, const mx::array& scales, const mx::array& biases,
                   int group_size, int bits) {
  need_f32(scales, "embed", "scales");
  need_f32(biases, "embed", "biases");
  if (ids.dtype() != mx::uint32 && ids.dtype() != mx::int32)
    throw std::invalid_argument("edge0 embed: ids must be uint32 or int32");
  if (bits != 4 && bits != 8) throw std::invalid_argument("edge0 embed: bits must be 4 or 8");
  const int64_t D = w.ndim() == 2 ? w.shape(1) * (32 / bits) : 0;
  if (w.dtype() != mx::uint32 || D < 1 || group_size < 1 || D % group_size || scales.ndim() != 2 ||
      scales.shape(0) != w.shape(0) || scales.shape(1) != D / group_size || biases.shape() != scales.shape())
    throw std::invalid_argument("edge0 embed: w (V, D*bits/32) uint32, scales and biases (V, D/group_size)");
  auto shape = ids.shape();
  shape.push_back((int)D);
  auto s = mx::default_stream(mx::Device::cpu);
  return held_node(shape, mx::float32, std::make_shared<EmbedOp>(s, group_size, bits), {ids, w, scales, biases});
}

mx::array rope_op(const mx::array& x, int dims, bool traditional, float base, float scale, int64_t offset,
                  const std::optional<mx::array>& offsets) {
  need_f32(x, "rope", "x");
  if (x.ndim() != 4 || dims <= 0 || dims % 2 || dims > x.shape(3))
    throw std::invalid_argument("edge0 rope: x must be (B, H, L, Dh) and dims even, at most Dh");
  need_rows(offsets, x.shape(0), "rope", "offsets");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> in{x};
  if (offsets) in.push_back(*offsets);
  return mx::array(x.shape(), mx::float32, std::make_shared<RoPEOp>(s, dims, traditional, base, scale, offset), in);
}

}  // namespace edge0
