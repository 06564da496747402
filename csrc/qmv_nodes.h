// The quantized products as MLX graph nodes (Edge0QMV, Edge0GLU, Edge0QMVLoRA) over qmv.h's kernels, and the checks
// of their arguments that the blocks built from them (attention_nodes, moe_nodes) share.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nodes.h"
#include "pack_cache.h"
#include "qmv.h"

namespace edge0 {

// y (R, N) += scale * (xd A) B, A and B arrays (D, r) and (r, N) of float32 or bfloat16: a branch beside a block
void adapt_arrays(const float* xd, int64_t R, int64_t D, const mx::array& a, const mx::array& b, float scale,
                  float* y);
// The projection of R rows xd of D values; its weights in[w], in[w + 1], in[w + 2][, adapter in[w + 3], in[w + 4]].
void project_rows(const float* xd, int64_t R, int64_t D, const std::vector<mx::array>& in, size_t w,
                  const Projection& p, float* y);
// in[0] (x) and the weights after it
void project(const std::vector<mx::array>& in, const Projection& p, float* y);


// Output row o reads x row o / ratio (ratio = rows per x row) and expert idx[o] (or 0 without idx).
// Inputs: x (..., D), w, scales, biases[, idx (any shape, R entries)]; output R x N, in any shape.
// With glu, the weights are those of gate, up and down (9 arrays) and row o is
// down[idx[o]] @ (silu(gate[idx[o]] @ x) * (up[idx[o]] @ x)): a routed expert's whole product. With combine (a glu
// with idx), one more input, scores (T, K): the output is (T, N), each token's K rows weighed and summed as
// Edge0Combine sums them (combine_op builds it from a GLU node and its scores).
class QMV : public mx::UnaryPrimitive, public Computes {
 public:
  QMV(mx::Stream stream, int group_size, int64_t ratio, bool has_idx, bool glu, bool combine = false)
      : mx::UnaryPrimitive(stream), group_size_(group_size), ratio_(ratio), has_idx_(has_idx), glu_(glu),
        combine_(combine) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, gs = group_size_, ratio = ratio_, has_idx = has_idx_, glu = glu_,
                  combine = combine_]() mutable {
      const int64_t D = inputs[0].shape(-1), Rx = inputs[0].size() / D;
      ProfileScope scope([&] {
        return std::string(glu ? (combine ? "Edge0GLU+Combine " : "Edge0GLU ") : "Edge0QMV ") +
               std::to_string(inputs[1].shape(-2)) + "x" + std::to_string(D) + (Rx >= PROMPT_ROWS ? " prompt" : "");
      });
      run(inputs, out.data<float>(), out.size(), gs, ratio, has_idx, glu, combine);
    });
  }

  void compute(const std::vector<mx::array>& in, float* out, int64_t size) const override {
    run(in, out, size, group_size_, ratio_, has_idx_, glu_, combine_);
  }

  // remap (optional): each index's position in the weights (a slot bank's table of expert id -> slot)
  static void run(const std::vector<mx::array>& inputs, float* out, int64_t size, int gs, int64_t ratio, bool has_idx,
                  bool glu, bool combine, const uint32_t* remap = nullptr);

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }

  const char* name() const override { return glu_ ? "Edge0GLU" : "Edge0QMV"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMV&>(other);
    return group_size_ == o.group_size_ && ratio_ == o.ratio_ && has_idx_ == o.has_idx_ && glu_ == o.glu_ &&
           combine_ == o.combine_;
  }
  // a GLU node (not a combined one) with indices: combine_op can take its place
  bool combinable() const { return glu_ && has_idx_ && !combine_; }
  // a plain product (no indices): another node can run it; none (inputs 0) otherwise
  Projection projection() const { return glu_ || has_idx_ ? Projection{} : Projection{4, group_size_, 0.f}; }
  std::shared_ptr<QMV> combined() {
    return std::make_shared<QMV>(stream(), group_size_, ratio_, has_idx_, glu_, true);
  }

 private:
  int group_size_;
  int64_t ratio_;
  bool has_idx_, glu_, combine_;
};

// A dense quantized linear with an unmerged low-rank adapter, one node: out = W x + scale * (x A) B, for
// x (..., D), W (N, D*bits/32), A (D, r), B (r, N) float32 (the recovery adapter of model/lora.py).
class QMVLoRA : public mx::UnaryPrimitive, public Computes {
 public:
  QMVLoRA(mx::Stream stream, int group_size, float scale)
      : mx::UnaryPrimitive(stream), group_size_(group_size), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, gs = group_size_, scale = scale_]() mutable {
      const int64_t D = inputs[0].shape(-1), R = inputs[0].size() / D;
      ProfileScope scope([&] {
        return "Edge0QMV+LoRA " + std::to_string(inputs[1].shape(-2)) + "x" + std::to_string(D) +
               (R >= PROMPT_ROWS ? " prompt" : "");
      });
      project(inputs, Projection{6, gs, scale}, out.data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }
  const char* name() const override { return "Edge0QMVLoRA"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMVLoRA&>(other);
    return group_size_ == o.group_size_ && scale_ == o.scale_;
  }
  Projection projection() const { return {6, group_size_, scale_}; }
  void compute(const std::vector<mx::array>& in, float* out, int64_t) const override { project(in, projection(), out); }

 private:
  int group_size_;
  float scale_;
};

[[noreturn]] void fail(const std::string& m);  // invalid_argument "edge0 qmv/glu: m"
// w (E, N, D*bits/32) or (N, D*bits/32) uint32 (4 or 8 bits), scales and biases (..., N, D/gs) float32 or both
// bfloat16, checked -> N
int64_t check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int64_t D, int group_size);
// x (..., D) float32 of at least one row, a supported group size, checked; returns the rows of x.
int64_t check_x(const mx::array& x, int group_size);
// Whether an adapter's lora_a and lora_b are (D, r) and (r, N), both float32 or both bfloat16.
bool lora_fits(const mx::array& a, const mx::array& b, int64_t D, int64_t N);
// Routed experts' gate, up, down (w, scales, biases each) for inputs of width D, checked: the down projection's width.
int64_t check_glu(const std::vector<mx::array>& gate, const std::vector<mx::array>& up,
                  const std::vector<mx::array>& down, int64_t D, int group_size);

mx::array qmv_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                 std::optional<mx::array> idx, int group_size, std::optional<std::vector<int>> shape);
mx::array qmv_lora_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                      const mx::array& a, const mx::array& b, float scale, int group_size);
mx::array glu_op(const mx::array& x, const mx::array& idx, const std::vector<mx::array>& gate,
                 const std::vector<mx::array>& up, const std::vector<mx::array>& down, int group_size,
                 std::optional<std::vector<int>> shape);

}  // namespace edge0
