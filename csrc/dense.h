// The per-token dense ops of a decoder layer that MLX's CPU backend runs as a dozen small graph nodes
// each (its fast:: ops fall back to composed ops on the CPU, attention on the reference BLAS): RMS norm,
// rotary embedding and attention, each as one loop here. float32, no MLX types; strides in elements.
// Each runs on the build of dense.cpp set_dense_impl chose (below).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace edge0 {

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, for rows r of D contiguous floats.
void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* out);
// out = x - logsumexp(x) over each row of D: MLX's `x - mx.logsumexp(x, axis=-1, keepdims=True)` on the CPU, bit for bit
// (its maximum, its exp of x - max summed in order, log(sum) + max, then the subtraction), the exps 16 or 8 at a time.
void log_softmax(const float* x, int64_t rows, int64_t D, float* out);

// A (B, H, L, Dh) view: element (b, h, l, d) at data[b*s[0] + h*s[1] + l*s[2] + d*s[3]].
struct View4 {
  const float* data;
  int64_t shape[4];
  int64_t strides[4];
};

// Rotary embedding of the first `dims` features at positions (offset + l) * scale, as mx.fast.rope:
// traditional rotates pairs (2i, 2i+1), otherwise (i, i + dims/2); features past dims are copied.
// out is (B, H, L, Dh) contiguous. offsets (B entries, or null): sequence b's own offset instead of `offset`
// (a batch decoding together, mlx-lm's BatchKVCache), each row as it would be alone.
void rope(const View4& x, int dims, bool traditional, float base, float scale, int64_t offset, float* out,
          const int32_t* offsets = nullptr);

// Attention: q (B, Hq, L, Dh), k and v (B, Hkv, S, Dh), Hq a multiple of Hkv (grouped queries);
// softmax(scale * q k^T) v. causal: query l sees keys up to S - L + l (the queries are the last L
// positions), else every key. out is (B, Hq, L, Dh) contiguous. starts (B entries, or null): sequence b sees
// only keys from starts[b] on (a left-padded batch cache), as it would alone with its own S - starts[b] keys.
void attention(const View4& q, const View4& k, const View4& v, float scale, bool causal, float* out,
               const int32_t* starts = nullptr);

// Routing of T tokens over E experts: softmax, the k largest (by descending probability, ties to the
// lower id), their probabilities renormalised to sum 1 when norm. inds and scores are (T, k).
// among (T, M) ids, or null: the k are chosen among row t's M candidates only (an id >= E names none; fewer
// than k distinct: among all E); the probabilities are still the softmax over all E logits.
void softmax_topk(const float* logits, int64_t T, int64_t E, int k, bool norm, uint32_t* inds, float* scores,
                  const uint32_t* among = nullptr, int64_t M = 0);

// out[r, n] = x[r] . w[n] (+ bias[n]) for x (rows, D), w (N, D), float32: a float linear whose every output is
// one fixed-order sum, so a row's result does not depend on the other rows (a batch equals its rows run alone).
// w may be bfloat16 (its bits as uint16), widened exactly: the bits of float32 weights of the same values.
void linear(const float* x, int64_t rows, const float* w, const float* bias, int64_t N, int64_t D, float* out);
void linear(const float* x, int64_t rows, const uint16_t* w, const float* bias, int64_t N, int64_t D, float* out);

// A prerouter head (edge0/model/heads.py) on rows of token state: features f = [x, multi-hot(now), multi-hot(prev)]
// (D + 2E; ids >= E name no expert, prev null: zeros), out = (router + delta f) + fc2 gelu(fc1 f + b1) + b2, each
// product as `linear` computes it. x (rows, D), now and prev (rows, k), router and out (rows, N), delta (N, D + 2E),
// w1 (H, D + 2E), b1 (H), w2 (N, H), b2 (N).
void head(const float* x, const uint32_t* now, const uint32_t* prev, int64_t rows, int k, int64_t D, int64_t E,
          const float* router, const float* delta, const float* w1, const float* b1, int64_t H, const float* w2,
          const float* b2, int64_t N, float* out);
// the same with delta, w1 and w2 bfloat16, widened exactly (half the bytes a step reads)
void head(const float* x, const uint32_t* now, const uint32_t* prev, int64_t rows, int k, int64_t D, int64_t E,
          const float* router, const uint16_t* delta, const uint16_t* w1, const float* b1, int64_t H,
          const uint16_t* w2, const float* b2, int64_t N, float* out);

// y[i] = exp(x[i]) and erf(x[i]) for i < n as MLX's CPU backend computes them (mx.exp, mx.erf), bit for bit,
// vectorized (x == y allowed).
void exp_mlx(const float* x, float* y, int64_t n);
void erf_mlx(const float* x, float* y, int64_t n);

// g[i] = silu(g[i]) * u[i] for i < n (a routed expert's SwiGLU between its products), vectorized with MLX's exp.
void swiglu(float* g, const float* u, int64_t n);

// Rows of an affine-quantized embedding table: out[i] = scales[id] * q + biases[id] per group of gs, for the n ids
// (q the bits-wide values packed little-endian in uint32 words, as MLX packs them), each element as mx.dequantize
// computes it (a product, then a sum: two roundings). w (V, D*bits/32), scales and biases (V, D/gs); an id >= V
// gives a row of zeros.
void embed(const int64_t* ids, int64_t n, const uint32_t* w, const float* scales, const float* biases, int64_t V,
           int64_t D, int gs, int bits, float* out);

// out[t] = sum_j scores[t, j] * y[t, j] for y (T, k, D) and scores (T, k): the routed experts' weighted sum.
void combine(const float* y, const float* scores, int64_t T, int k, int64_t D, float* out);

// y (R, N) += scale * (xd A) B: an unmerged adapter's branch, A (D, r) and B (r, N), float32 or bfloat16 bits (widened
// exactly); each row as it is alone.
void adapt(const float* xd, int64_t R, int64_t D, const float* a, const float* b, int64_t N, int64_t r, float scale,
           float* y);
void adapt(const float* xd, int64_t R, int64_t D, const uint16_t* a, const uint16_t* b, int64_t N, int64_t r,
           float scale, float* y);

// The code path of the functions above: dense.cpp is built once for each instruction set the machine runs (its own,
// AVX2, plain C++: CMakeLists.txt), and they run the build chosen here, the widest by default. Names "avx512", "avx2",
// "portable" (dense_impls: those built, narrowest first); set_dense_impl is false for one not built. Tests run the
// narrower paths on a wider machine.
std::vector<std::string> dense_impls();
const char* dense_impl();
bool set_dense_impl(const char* name);

}  // namespace edge0
