// dense.h's functions on the build of dense.cpp chosen at run time (dense_ops.h): one indirect call a graph node.

#include "dense_ops.h"

#include <atomic>
#include <cstring>

namespace edge0 {

// The builds, widest first; one of each name (on a machine without AVX-512, native's build is avx2's).
static const std::vector<const DenseOps*>& builds() {
  static const std::vector<const DenseOps*> all = [] {
    std::vector<const DenseOps*> out;
    for (const DenseOps* b : {&native::ops,
#if defined(EDGE0_DENSE_AVX2)
                              &avx2::ops,
#endif
#if defined(EDGE0_DENSE_PORTABLE)
                              &portable::ops,
#endif
         }) {
      bool seen = false;
      for (const DenseOps* o : out) seen = seen || std::strcmp(o->name, b->name) == 0;
      if (!seen) out.push_back(b);
    }
    return out;
  }();
  return all;
}

static std::atomic<const DenseOps*> chosen{&native::ops};
static inline const DenseOps& use() { return *chosen.load(std::memory_order_relaxed); }

std::vector<std::string> dense_impls() {
  std::vector<std::string> out;  // narrowest first, as qmv's impls
  for (auto b = builds().rbegin(); b != builds().rend(); ++b) out.push_back((*b)->name);
  return out;
}

const char* dense_impl() { return use().name; }

bool set_dense_impl(const char* name) {
  for (const DenseOps* b : builds())
    if (std::strcmp(b->name, name) == 0) {
      chosen.store(b);
      return true;
    }
  return false;
}

void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* out) {
  use().rms_norm(x, w, eps, rows, D, out);
}
void log_softmax(const float* x, int64_t rows, int64_t D, float* out) { use().log_softmax(x, rows, D, out); }
void rope(const View4& x, int dims, bool traditional, float base, float scale, int64_t offset, float* out,
          const int32_t* offsets) {
  use().rope(x, dims, traditional, base, scale, offset, out, offsets);
}
void attention(const View4& q, const View4& k, const View4& v, float scale, bool causal, float* out,
               const int32_t* starts) {
  use().attention(q, k, v, scale, causal, out, starts);
}
void softmax_topk(const float* logits, int64_t T, int64_t E, int k, bool norm, uint32_t* inds, float* scores,
                  const uint32_t* among, int64_t M) {
  use().softmax_topk(logits, T, E, k, norm, inds, scores, among, M);
}
void linear(const float* x, int64_t rows, const float* w, const float* bias, int64_t N, int64_t D, float* out) {
  use().linear(x, rows, w, bias, N, D, out);
}
void linear(const float* x, int64_t rows, const uint16_t* w, const float* bias, int64_t N, int64_t D, float* out) {
  use().linear16(x, rows, w, bias, N, D, out);
}
void head(const float* x, const uint32_t* now, const uint32_t* prev, int64_t rows, int k, int64_t D, int64_t E,
          const float* router, const float* delta, const float* w1, const float* b1, int64_t H, const float* w2,
          const float* b2, int64_t N, float* out) {
  use().head(x, now, prev, rows, k, D, E, router, delta, w1, b1, H, w2, b2, N, out);
}
void head(const float* x, const uint32_t* now, const uint32_t* prev, int64_t rows, int k, int64_t D, int64_t E,
          const float* router, const uint16_t* delta, const uint16_t* w1, const float* b1, int64_t H,
          const uint16_t* w2, const float* b2, int64_t N, float* out) {
  use().head16(x, now, prev, rows, k, D, E, router, delta, w1, b1, H, w2, b2, N, out);
}
void exp_mlx(const float* x, float* y, int64_t n) { use().exp_mlx(x, y, n); }
void erf_mlx(const float* x, float* y, int64_t n) { use().erf_mlx(x, y, n); }
void swiglu(float* g, const float* u, int64_t n) { use().swiglu(g, u, n); }
void embed(const int64_t* ids, int64_t n, const uint32_t* w, const float* scales, const float* biases, int64_t V,
           int64_t D, int gs, int bits, float* out) {
  use().embed(ids, n, w, scales, biases, V, D, gs, bits, out);
}
void combine(const float* y, const float* scores, int64_t T, int k, int64_t D, float* out) {
  use().combine(y, scores, T, k, D, out);
}
void adapt(const float* xd, int64_t R, int64_t D, const float* a, const float* b, int64_t N, int64_t r, float scale,
           float* y) {
  use().adapt(xd, R, D, a, b, N, r, scale, y);
}
void adapt(const float* xd, int64_t R, int64_t D, const uint16_t* a, const uint16_t* b, int64_t N, int64_t r,
           float scale, float* y) {
  use().adapt16(xd, R, D, a, b, N, r, scale, y);
}

}  // namespace edge0
