// The MoE block's nodes: routing (softmax top-k), the routed experts' weighted sum, a recovery adapter's branch beside
// the block, and the whole block of resident experts (or a slot bank's) as one node. The routed experts' products
// are qmv_nodes.h's.
#pragma once

#include <optional>
#include <vector>

#include "nodes.h"

namespace edge0 {

// The ops bindings.cpp binds (documented there).
std::vector<mx::array> softmax_topk_op(const mx::array& logits, int k, bool norm,
                                       std::optional<mx::array> among);
mx::array combine_op(const mx::array& y, const mx::array& scores);
mx::array adapt_add_op(const mx::array& y, const mx::array& x, const mx::array& a, const mx::array& b,
                       float scale);
std::vector<mx::array> moe_block_op(const mx::array& x, const mx::array& h, const std::vector<mx::array>& router,
                                    int router_group_size, int k, bool norm_topk,
                                    const std::optional<mx::array>& among, const std::vector<mx::array>& gate,
                                    const std::vector<mx::array>& up, const std::vector<mx::array>& down,
                                    int group_size, const mx::array& norm, float eps,
                                    const std::optional<mx::array>& lora_a,
                                    const std::optional<mx::array>& lora_b, float lora_scale,
                                    const std::optional<mx::array>& table);

}  // namespace edge0
