// The MoE block's nodes (moe_nodes.h).
#include "moe_nodes.h"

#include <stdexcept>

#include "dense_nodes.h"
#include "qmv_nodes.h"

namespace edge0 {

class CombineOp : public DenseOp {
 public:
  using DenseOp::DenseOp;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<float> yt, st;
      const int k = in[1].shape(-1);
      const int64_t D = in[0].shape(-1);
      combine(dense_data<float>(in[0], yt), dense_data<float>(in[1], st), in[1].size() / k, k, D, o.data<float>());
    });
  }
  const char* name() const override { return "Edge0Combine"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// Routing as one node with two outputs: (inds uint32, scores float32), each (..., k), from the router's logits
// (..., E); where they are the router's product, not yet evaluated, that product runs here too.
class RouterOp : public MultiOp {
 public:
  RouterOp(mx::Stream s, int k, bool norm, int64_t E, Absorbed logits = {}, bool among = false)
      : MultiOp(s), k_(k), norm_(norm), E_(E), among_(among), logits_(std::move(logits)),
        name_(logits_.name("Edge0SoftmaxTopK")) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(inputs, outputs, [k = k_, norm = norm_, E = E_, among = among_, l = logits_](
                                  const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<float> lt;
      std::vector<uint32_t> ct;
      const int64_t T = out[0].size() / k, M = among ? in.back().shape(-1) : 0;
      softmax_topk(l.values(in, 0, T * E, lt), T, E, k, norm, out[0].data<uint32_t>(), out[1].data<float>(),
                   among ? dense_data<uint32_t>(in.back(), ct) : nullptr, M);
    });
  }
  const char* name() const override { return name_; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RouterOp&>(other);
    return k_ == o.k_ && norm_ == o.norm_ && E_ == o.E_ && among_ == o.among_ && logits_ == o.logits_ &&
           held_ == o.held_;
  }

 private:
  int k_;
  bool norm_;
  int64_t E_;
  bool among_;  // a last input (T, M) of candidate ids: the k are chosen among them
  Absorbed logits_;  // the router's product, run here
  const char* name_;
};

// An MoE block of resident experts for the new token of each of T rows, as one node: the router's product, its
// softmax top-k (among the candidates, a last input, when given), the routed experts' SwiGLU, their weighted sum and
// the residual add with the RMS norm after it. Each part runs the function its own node runs (QMV, SoftmaxTopK,
// GLU+Combine, AddRMSNorm), in that order on the same values, so the bits of those four nodes, from one.
// With a recovery adapter's branch beside the block (lora_a, lora_b: two last inputs, and its scale), the experts' sum
// then takes the branch as AdaptAdd adds it (the same function), before the add-norm. With a table (E,) uint32, the
// experts are a slot bank's S slots and table[id] is the slot holding expert id (a streamed layer whose candidates
// were read a step ahead): the routed ids stay expert ids, their products read the slots.
// Inputs: x, router (w, scales, biases), gate, up, down (w, scales, biases each), h, norm weight[, among][, table]
// [, lora_a, lora_b]; outputs: h + the experts' sum, its norm, the routed ids (T.., k) and their weights.
class MoeBlockOp : public MultiOp {
 public:
  MoeBlockOp(mx::Stream s, int router_gs, int k, bool norm_topk, bool among, bool table, int gs, float eps,
             float branch)
      : MultiOp(s), router_gs_(router_gs), k_(k), norm_topk_(norm_topk), among_(among), table_(table), gs_(gs),
        eps_(eps), branch_(branch) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(inputs, outputs, [rgs = router_gs_, k = k_, norm = norm_topk_, among = among_, table = table_, gs = gs_,
                               eps = eps_, branch = branch_](const std::vector<mx::array>& in,
                                                             std::vector<mx::array>& out) {
      const int64_t D = in[0].shape(-1), T = in[0].size() / D, E = in[1].shape(-2), N = in[10].shape(-2);
      std::vector<float> logits(T * E), y(T * N), ht, wt;
      QMV::run({in[0], in[1], in[2], in[3]}, logits.data(), T * E, rgs, 1, false, false, false);
      std::vector<uint32_t> ct;
      softmax_topk(logits.data(), T, E, k, norm, out[2].data<uint32_t>(), out[3].data<float>(),
                   among ? dense_data<uint32_t>(in[15], ct) : nullptr, among ? in[15].shape(-1) : 0);
      std::vector<mx::array> glu{in[0], in[4], in[5], in[6], in[7], in[8], in[9], in[10], in[11], in[12], out[2],
                                 out[3]};
      std::vector<uint32_t> tt;
      QMV::run(glu, y.data(), T * N, gs, k, true, true, true,
               table ? dense_data<uint32_t>(in[15 + among], tt) : nullptr);
      if (branch != 0.f) {
        std::vector<float> xt;
        const size_t at = in.size() - 2;
        adapt_arrays(dense_data<float>(in[0], xt), T, D, in[at], in[at + 1], branch, y.data());
      }
      AddRMSNormOp::add_norm(dense_data<float>(in[13], ht), y.data(), dense_data<float>(in[14], wt), eps, T * N, N,
                             out[0].data<float>(), out[1].data<float>());
    });
  }
  const char* name() const override { return "Edge0MoeBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const MoeBlockOp&>(other);
    return router_gs_ == o.router_gs_ && k_ == o.k_ && norm_topk_ == o.norm_topk_ && among_ == o.among_ &&
           table_ == o.table_ && gs_ == o.gs_ && eps_ == o.eps_ && branch_ == o.branch_ && held_ == o.held_;
  }

 private:
  int router_gs_, k_;
  bool norm_topk_, among_, table_;
  int gs_;
  float eps_, branch_;  // branch_: the adapter branch's scale (0: none)
};

// y + scale * (x A) B for rows of y (N) and x (D): a recovery adapter's branch beside a block whose output is y
// (an MoE block's experts' sum), added in y's place by the function qmv_lora adds its branch with.
class AdaptAdd : public mx::UnaryPrimitive {
 public:
  AdaptAdd(mx::Stream s, float scale) : mx::UnaryPrimitive(s), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, scale = scale_]() mutable {
      ProfileScope scope([] { return std::string("Edge0AdaptAdd"); });
      std::vector<float> yt, xt;
      const int64_t D = inputs[1].shape(-1), R = inputs[1].size() / D;
      const float* y = dense_data<float>(inputs[0], yt);
      std::copy(y, y + out.size(), out.data<float>());
      adapt_arrays(dense_data<float>(inputs[1], xt), R, D, inputs[2], inputs[3], scale, out.data<float>());
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }
  const char* name() const override { return "Edge0AdaptAdd"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const AdaptAdd&>(other).scale_;
  }

 private:
  float scale_;
};

std::vector<mx::array> softmax_topk_op(const mx::array& logits, int k, bool norm,
                                       std::optional<mx::array> among) {
  need_f32(logits, "softmax_topk", "logits");
  if (logits.ndim() < 1 || k < 1 || k > logits.shape(-1))
    throw std::invalid_argument("edge0 softmax_topk: logits (..., E) and 1 <= k <= E");
  if (among && (among->dtype() != mx::uint32 || among->ndim() != logits.ndim() || among->shape(-1) < k ||
                among->size() / among->shape(-1) != logits.size() / logits.shape(-1)))
    throw std::invalid_argument("edge0 softmax_topk: among must be uint32 (..., M), M >= k, a row per logits row");
  auto shape = logits.shape();
  shape.back() = k;
  auto s = mx::default_stream(mx::Device::cpu);
  const Absorbed from = absorbable_node(logits);  // the router's product runs inside this node
  auto in = leading(logits, from);
  if (among) in.push_back(*among);
  return held_nodes({shape, shape}, {mx::uint32, mx::float32},
                    std::make_shared<RouterOp>(s, k, norm, logits.shape(-1), from, (bool)among), std::move(in));
}

mx::array combine_op(const mx::array& y, const mx::array& scores) {
  need_f32(y, "combine", "y");
  need_f32(scores, "combine", "scores");
  if (y.ndim() < 2 || y.shape(-2) < 1 || scores.shape() != mx::Shape(y.shape().begin(), y.shape().end() - 1))
    throw std::invalid_argument("edge0 combine: y (..., K, D) and scores (..., K), K >= 1");
  auto shape = scores.shape();
  shape.back() = y.shape(-1);
  // y the routed experts' GLU node, not yet evaluated: one node that runs it and sums its rows (the same bits)
  if (auto* glu = y.status() == mx::array::Status::unscheduled ? dynamic_cast<QMV*>(&y.primitive()) : nullptr;
      glu && glu->combinable() && y.inputs().back().size() == scores.size()) {
    auto in = y.inputs();
    in.push_back(scores);
    return mx::array(shape, mx::float32, glu->combined(), std::move(in));
  }
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<CombineOp>(s), {y, scores});
}

mx::array adapt_add_op(const mx::array& y, const mx::array& x, const mx::array& a, const mx::array& b,
                       float scale) {
  need_f32(y, "adapt_add", "y");
  need_f32(x, "adapt_add", "x");
  const int64_t D = x.shape(-1), N = y.shape(-1);
  if (D == 0 || N == 0 || x.size() / D != y.size() / N || !lora_fits(a, b, D, N))
    fail("adapt_add: x (R, D), y (R, N), lora_a (D, r) and lora_b (r, N), both float32 or both bfloat16");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(y.shape(), mx::float32, std::make_shared<AdaptAdd>(s, scale), {y, x, a, b});
}

// One new token's MoE block for each of its rows (one sequence, or a served batch) with every expert resident: the
// router's product, its softmax top-k (chosen among `among`, predicted routing's candidates, when given), the routed
// experts' SwiGLU, their weighted sum and the residual add with the RMS norm after it, as one node (MoeBlockOp) with
// the bits of the nodes SoftmaxMoeBlock, compute/qmm.py gather_glu, compute/routing.py and add_norm build one by one.
// With `table`, the experts are a slot bank (see MoeBlockOp). Returns (h + the experts' sum, its norm, the routed ids).
std::vector<mx::array> moe_block_op(const mx::array& x, const mx::array& h, const std::vector<mx::array>& router,
                                    int router_group_size, int k, bool norm_topk,
                                    const std::optional<mx::array>& among, const std::vector<mx::array>& gate,
                                    const std::vector<mx::array>& up, const std::vector<mx::array>& down,
                                    int group_size, const mx::array& norm, float eps,
                                    const std::optional<mx::array>& lora_a,
                                    const std::optional<mx::array>& lora_b, float lora_scale,
                                    const std::optional<mx::array>& table) {
  if (router.size() != 3) fail("moe_block: the router is (w, scales, biases)");
  const int64_t T = check_x(x, router_group_size), D = x.shape(-1);
  check_x(x, group_size);
  const int64_t E = check_weights(router[0], router[1], router[2], D, router_group_size);
  if (router[0].ndim() != 2 || k < 1 || k > E) fail("moe_block: the router must be (E, D*bits/32) and 1 <= k <= E");
  if (check_glu(gate, up, down, D, group_size) != D || (!table && gate[0].shape(0) != E))
    fail("moe_block: the experts must be the router's E, their down projection back to D");
  if (table && (table->dtype() != mx::uint32 || table->ndim() != 1 || table->shape(0) != E))
    fail("moe_block: the table must be uint32 (E,): each expert's slot in the bank");
  need_f32(h, "moe_block", "h");
  need_f32(norm, "moe_block", "the norm weight");
  if (h.shape() != x.shape() || norm.ndim() != 1 || norm.shape(0) != D)
    fail("moe_block: h must be x's shape and the norm weight (D,)");
  if (among && (among->dtype() != mx::uint32 || among->shape(-1) < k || among->size() / among->shape(-1) != T))
    fail("moe_block: among must be uint32 (..., M), M >= k, a row per token");
  std::vector<mx::array> in{x, router[0], router[1], router[2]};
  for (auto* part : {&gate, &up, &down}) in.insert(in.end(), part->begin(), part->end());
  in.push_back(h);
  in.push_back(norm);
  if (among) in.push_back(*among);
  if (table) in.push_back(*table);
  if (lora_a.has_value() != lora_b.has_value()) fail("moe_block: lora_a and lora_b come together");
  if (lora_a) {
    if (!lora_fits(*lora_a, *lora_b, D, D) || lora_scale == 0.f)
      fail("moe_block: the branch must be lora_a (D, r) and lora_b (r, D), both float32 or both bfloat16, scale not 0");
    in.push_back(*lora_a);
    in.push_back(*lora_b);
  }
  mx::Shape ids(x.shape().begin(), x.shape().end());
  ids.back() = k;
  auto s = mx::default_stream(mx::Device::cpu);
  auto op = std::make_shared<MoeBlockOp>(s, router_group_size, k, norm_topk, (bool)among, (bool)table, group_size, eps,
                                         lora_a ? lora_scale : 0.f);
  op->hold(in);  // the router's, the experts' and the branch's weights
  auto out = mx::array::make_arrays({x.shape(), x.shape(), ids, ids}, {mx::float32, mx::float32, mx::uint32, mx::float32},
                                    std::move(op), std::move(in));
  return {out[0], out[1], out[2]};
}

}  // namespace edge0
