// Attention's nodes: a prompt's attention (Edge0Attention), and a new token's, of one sequence or of each of a batch:
// its KV cache writes (Edge0KVWrite), its attention (Edge0DecodeAttention) and the whole attention block of a layer
// with its projections and the add-norm after it (Edge0AttentionBlock).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "nodes.h"

namespace edge0 {

// x's attention node (Edge0DecodeAttention, not yet evaluated) running the projection (weights: w, scales, biases[,
// lora_a, lora_b]) of its output itself, as one node of that shape; nothing where x is no such node.
std::optional<mx::array> attention_then(const mx::array& x, const std::vector<mx::array>& weights,
                                        const Projection& p, const mx::Shape& shape);

// How many times a KV write copied a cache buffer (it was held elsewhere) instead of writing it in place.
int64_t kv_copies();

// The ops bindings.cpp binds (documented there).
mx::array kv_write_op(const mx::array& x, const std::optional<mx::array>& norm, const mx::array& buffer,
                      int64_t offset, float eps, int dims, bool traditional, float base, float rope_scale,
                      const std::optional<mx::array>& positions);
mx::array decode_attention_op(const mx::array& q, const std::optional<mx::array>& norm, const mx::array& keys,
                              const mx::array& values, int64_t offset, float eps, int dims, bool traditional,
                              float base, float rope_scale, float scale,
                              const std::optional<mx::array>& positions,
                              const std::optional<mx::array>& starts);
std::vector<mx::array> attention_block_op(const mx::array& x, const mx::array& h,
                                          const std::vector<mx::array>& q, const std::vector<mx::array>& k,
                                          const std::vector<mx::array>& v, const std::vector<mx::array>& o,
                                          float lora_scale, int group_size, const mx::array& q_norm,
                                          float q_eps, const mx::array& k_norm, float k_eps,
                                          const mx::array& keys, const mx::array& values, int64_t offset,
                                          int dims, bool traditional, float base, float rope_scale, float scale,
                                          const mx::array& post_norm, float post_eps,
                                          const std::optional<mx::array>& positions,
                                          const std::optional<mx::array>& starts);
mx::array attention_op(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                       const std::optional<mx::array>& starts);

}  // namespace edge0
