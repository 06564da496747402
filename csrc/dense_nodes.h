// The per-token dense ops of dense.h as MLX graph nodes (float32 on the CPU): norms, the residual add with its norm,
// rotary embedding, float linears, the prerouter heads, the quantized embedding, log-softmax.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "nodes.h"

namespace edge0 {

// A decoder layer's residual add and the RMS norm after it as one node: h = x + r (MLX's Add, element by element)
// and rms_norm(h) (Edge0RMSNorm's bits). Inputs x, r (same shape), w (D,); outputs h, n. Where r is a node not yet
// evaluated that Computes (the attention block's output, the MoE block's combined experts), this node runs r's node
// itself (Absorbed): inputs r's inputs..., x, w; one node fewer, the same bits.
class AddRMSNormOp : public MultiOp {
 public:
  AddRMSNormOp(mx::Stream s, float eps, Absorbed r = {})
      : MultiOp(s), eps_(eps), r_(std::move(r)), name_(r_.name("Edge0AddRMSNorm")) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(inputs, outputs, [eps = eps_, rn = r_](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      run(in, out[0].data<float>(), out[1].data<float>(), out[0].size(), out[0].shape(-1), eps, rn);
    });
  }

  // the node's work on its inputs, into h and out (n values in rows of D)
  static void run(const std::vector<mx::array>& in, float* h, float* out, int64_t n, int64_t D, float eps,
                  const Absorbed& rn) {
    std::vector<float> xt, rt, wt;
    const size_t at = rn.from ? rn.inputs : 0;  // x, then r unless run here, then w
    add_norm(dense_data<float>(in[at], xt), rn.values(in, 1, n, rt), dense_data<float>(in[rn.from ? at + 1 : 2], wt),
             eps, n, D, h, out);
  }

  // h = x + r element by element, then out = rms_norm(h): n values in rows of D
  static void add_norm(const float* x, const float* r, const float* w, float eps, int64_t n, int64_t D, float* h,
                       float* out) {
    for (int64_t i = 0; i < n; i++) h[i] = x[i] + r[i];
    rms_norm(h, w, eps, n / D, D, out);
  }
  const char* name() const override { return name_; }  // Edge0GLU+AddRMSNorm running a GLU
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AddRMSNormOp&>(other);
    return eps_ == o.eps_ && r_ == o.r_;
  }

 private:
  float eps_;
  Absorbed r_;  // r's node, run here
  const char* name_;
};

mx::array math_op(mx::array x, const std::string& fn);
mx::array rms_norm_op(const mx::array& x, const mx::array& w, float eps);
mx::array log_softmax_op(const mx::array& x);
std::vector<mx::array> step_log_softmax_op(const mx::array& x);
std::vector<mx::array> add_rms_norm_op(const mx::array& x, const mx::array& r, const mx::array& w, float eps);
mx::array linear_op(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias);
mx::array head_op(const mx::array& x, const mx::array& now, const std::optional<mx::array>& prev,
                  const mx::array& router, const mx::array& delta, const mx::array& w1, const mx::array& b1,
                  const mx::array& w2, const mx::array& b2);
mx::array embed_op(const mx::array& ids, const mx::array& w, const mx::array& scales, const mx::array& biases,
                   int group_size, int bits);
mx::array rope_op(const mx::array& x, int dims, bool traditional, float base, float scale, int64_t offset,
                  const std::optional<mx::array>& offsets);

}  // namespace edge0
