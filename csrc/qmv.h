// 4-bit affine quantized matrix-vector products over MLX's packed layout, no MLX types here.
//
// Layout (as MLX stores it, no repacking): W (E, N, D*bits/32) uint32; 4-bit: 8 nibbles per word,
// element j of a word in bits 4j..4j+3; 8-bit: a byte per element. Scales and biases (E, N, D/gs)
// float32, or bfloat16 as stored (widened where each group is used, exactly); w = s * q + b per group.
// So per group: sum_i x_i w_i = s * sum_i x_i q_i + b * sum_i x_i.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace edge0 {

constexpr int MAX_GROUPS = 4096;  // D / group_size at most (per-row scratch on the stack)

// One output row o: its x row and its expert (the weight matrix it multiplies).
struct Pair {
  int64_t expert;
  int64_t xrow;
  int64_t out;
};

struct QWeights {
  const uint8_t* w;  // (E, N, D/2) bytes
  const float* scales;  // (E, N, D/gs) float32, or null with scales16
  const float* biases;  // (E, N, D/gs) float32, or null with biases16
  int64_t E, N, D;
  int group_size;
  int bits;  // 4 or 8
  const uint16_t* scales16 = nullptr;  // (E, N, D/gs) bfloat16 bits: 2 bytes a group instead of 4 to stream
  const uint16_t* biases16 = nullptr;
};

// Token rows from which a product or an attention is a prompt chunk (prefill), as its node's name says.
constexpr int64_t PROMPT_ROWS = 16;

// Token rows from which a node's work runs on the prompt threads (every core): a prompt chunk, or one step of a
// served batch of several sequences, whose products and attention are several times one sequence's; one
// sequence's decode step runs on the decode threads. Which threads compute an output never changes its bits.
constexpr int64_t SPREAD_ROWS = 4;
inline bool spread(int64_t rows) { return rows >= SPREAD_ROWS; }

// out[p.out, :N] = W[p.expert] @ x[p.xrow] for every pair; x (rows, D) float32, out (*, N) float32.
// prompt: on the prompt threads.
void qmv(const QWeights& q, const float* x, int64_t x_rows, const std::vector<Pair>& pairs, float* out,
         bool prompt = false);

// "avx512" (VNNI), "avx2" or "portable": the code path qmv takes (the best built by default);
// set_impl names another one built here (tests, benchmarks), false when it is not.
const char* impl();
bool set_impl(const char* name);

// Compute threads, the caller included (one persistent pool of max(n, prompt) - 1 workers): n for a
// decode step's products, prompt (n when 0) for prompt chunks'.
void set_num_threads(int n, int prompt = 0);
int num_threads();
int prompt_threads();

// fn(i) for every i in [0, n) on the pool's prompt threads (prompt) or decode threads, the caller included.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, bool prompt);

}  // namespace edge0
