// See dense.h. Plain loops the compiler vectorizes (-O3 -march=native, -fopenmp-simd for the sums); the work is tiny next to the
// quantized products, what they save is MLX's per-node dispatch. Built once per instruction set (CMakeLists.txt), each
// build in a namespace of its own (EDGE0_DENSE_NS) with its table of these functions (dense_ops.h).

#include "dense_ops.h"
#include "qmv.h"
#include "widen.h"

#include "mlx/backend/cpu/simd/math.h"  // MLX's own erf, so a head's gelu rounds as mlx.nn.gelu does

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#ifndef EDGE0_DENSE_NS
#define EDGE0_DENSE_NS native
#endif

namespace edge0 {
namespace EDGE0_DENSE_NS {

namespace mx_simd = mlx::core::simd;

// MLX's CPU exp and erf (mlx/backend/cpu/simd/math.h), which MLX runs one float at a time on Linux (Simd<float, 1>),
// here 16 or 8 lanes at a time with the same operations, each correctly rounded, in the same order: the same bits
// (tests/compute/test_kernels.py compares them with mx.exp and mx.erf). Two differences of form only: MLX's
// floor(x + 0.5) adds 0.5 as a double, which is exact, so floor(x) + (x - floor(x) >= 0.5) gives the same integer
// (the fraction's rounding cannot cross 0.5: 0.5 is a float); and its int conversion of that integer is a
// truncation here too.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define EDGE0_LANES_BUILT 1
// The lane operations of one vector width W (512 or 256 bits): the same intrinsic names but for the width.
#define EDGE0_LANE_OPS(W, SI)                                                                      \
  using Lanes = __m##W;                                                                            \
  constexpr int EXP_LANES = W / 32;                                                                \
  static inline Lanes load_lanes(const float* p) { return _mm##W##_loadu_ps(p); }                  \
  static inline void store_lanes(float* p, Lanes v) { _mm##W##_storeu_ps(p, v); }                  \
  static inline Lanes splat(float v) { return _mm##W##_set1_ps(v); }                               \
  static inline Lanes add_lanes(Lanes a, Lanes b) { return _mm##W##_add_ps(a, b); }                \
  static inline Lanes sub_lanes(Lanes a, Lanes b) { return _mm##W##_sub_ps(a, b); }                \
  static inline Lanes mul_lanes(Lanes a, Lanes b) { return _mm##W##_mul_ps(a, b); }                \
  static inline Lanes div_lanes(Lanes a, Lanes b) { return _mm##W##_div_ps(a, b); }                \
  static inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) { return _mm##W##_fmadd_ps(a, b, c); } \
  static inline Lanes neg_lanes(Lanes a) { return _mm##W##_xor_ps(a, splat(-0.f)); }               \
  static inline Lanes abs_lanes(Lanes a) { return _mm##W##_andnot_ps(splat(-0.f), a); }            \
  /* 2^i for the integral values i (as MLX: (int(i) + 127) << 23 read as a float) */                \
  static inline Lanes pow2_lanes(Lanes i) {                                                        \
    return _mm##W##_castsi##SI##_ps(                                                               \
        _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvttps_epi32(i), _mm##W##_set1_epi32(127)), 23)); \
  }
#endif
#if defined(__AVX512F__)
EDGE0_LANE_OPS(512, 512)
static inline Lanes floor_lanes(Lanes a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// where(a CMP b, then, otherwise)
template <int CMP>
static inline Lanes where(Lanes a, Lanes b, Lanes then, Lanes otherwise) {
  return _mm512_mask_mov_ps(otherwise, _mm512_cmp_ps_mask(a, b, CMP), then);
}
#elif defined(__AVX2__) && defined(__FMA__)
EDGE0_LANE_OPS(256, 256)
static inline Lanes floor_lanes(Lanes a) { return _mm256_floor_ps(a); }
template <int CMP>
static inline Lanes where(Lanes a, Lanes b, Lanes then, Lanes otherwise) {
  return _mm256_blendv_ps(otherwise, then, _mm256_cmp_ps(a, b, CMP));
}
#endif

#if defined(EDGE0_LANES_BUILT)
static inline Lanes exp_lanes(Lanes xin) {
  const Lanes x = mul_lanes(xin, splat(1.442695f));
  const Lanes fl = floor_lanes(x);
  const Lanes ipart = where<_CMP_GE_OQ>(sub_lanes(x, fl), splat(0.5f), add_lanes(fl, splat(1.f)), fl);
  const Lanes fpart = sub_lanes(x, ipart);
  Lanes p = splat(1.535336188319500e-4f);
  for (const float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                        6.931472028550421e-1f, 1.000000000000000f})
    p = fma_lanes(p, fpart, splat(c));
  Lanes r = mul_lanes(pow2_lanes(ipart), p);
  r = where<_CMP_UNORD_Q>(xin, xin, xin, r);  // NaN stays itself
  r = where<_CMP_GT_OQ>(xin, splat(88.f), splat(INFINITY), r);
  return where<_CMP_LT_OQ>(xin, splat(-88.f), splat(0.f), r);
}

static inline Lanes erf_lanes(Lanes v) {
  const Lanes t = div_lanes(splat(1.f), fma_lanes(splat(0.3275911f), abs_lanes(v), splat(1.f)));
  Lanes r = fma_lanes(splat(1.061405429f), t, splat(-1.453152027f));
  for (const float c : {1.421413741f, -0.284496736f, 0.254829592f}) r = fma_lanes(r, t, splat(c));
  const Lanes e = neg_lanes(exp_lanes(mul_lanes(neg_lanes(v), v)));
  const Lanes res = fma_lanes(mul_lanes(e, t), r, splat(1.f));
  return where<_CMP_GT_OQ>(v, splat(0.f), res, neg_lanes(res));
}
#endif

// flatten: MLX's functions inlined here, compiled for this build's instructions (an out-of-line copy is one symbol that
// the linker would share among dense.cpp's builds: CMakeLists.txt)
__attribute__((flatten)) static inline float exp1(float x) { return mx_simd::exp(mx_simd::Simd<float, 1>(x)).value; }
__attribute__((flatten)) static inline float erf1(float x) { return mx_simd::erf(mx_simd::Simd<float, 1>(x)).value; }

// y[i] = f(x[i]) for i < n with the lanes' form (fv) or one at a time (f1) past the last whole vector: the bits
// of f1 either way.
template <class FV, class F1>
static inline void each(const float* x, float* y, int64_t n, [[maybe_unused]] FV fv, F1 f1) {
  int64_t i = 0;
#if defined(EDGE0_LANES_BUILT)
  for (; i + EXP_LANES <= n; i += EXP_LANES) store_lanes(y + i, fv(load_lanes(x + i)));
#endif
  for (; i < n; i++) y[i] = f1(x[i]);
}

#if defined(EDGE0_LANES_BUILT)
#define EDGE0_LANES(expr) [](auto v) { return expr; }
#else
#define EDGE0_LANES(expr) nullptr
#endif

void exp_mlx(const float* x, float* y, int64_t n) { each(x, y, n, EDGE0_LANES(exp_lanes(v)), exp1); }
void erf_mlx(const float* x, float* y, int64_t n) { each(x, y, n, EDGE0_LANES(erf_lanes(v)), erf1); }

#if defined(__AVX2__) && defined(__FMA__)
// The G dot products of G query rows (qv, G x Dh, contiguous) with each of KB key rows (kr, kr + ks, ...), into
// dot[i][0..G): the KB x G sums advance together, 8 lanes at a time, independent FMA chains instead of one chain
// per dot (a decode step's attention was bound by that latency, not by the bytes). A dot's operations and their
// order do not depend on KB or G, so neither do its bits. Needs Dh % 8 == 0.
template <int G, int KB>
static inline void key_dots(const float* qv, const float* kr, int64_t ks, int64_t Dh, float (*dot)[G]) {
  __m256 acc[KB][G];
  for (int i = 0; i < KB; i++)
    for (int g = 0; g < G; g++) acc[i][g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dh; d += 8) {
    __m256 q[G];
    for (int g = 0; g < G; g++) q[g] = _mm256_loadu_ps(qv + g * Dh + d);
    for (int i = 0; i < KB; i++) {
      const __m256 kv = _mm256_loadu_ps(kr + i * ks + d);
      for (int g = 0; g < G; g++) acc[i][g] = _mm256_fmadd_ps(q[g], kv, acc[i][g]);
    }
  }
  for (int i = 0; i < KB; i++)
    for (int g = 0; g < G; g++) {
      const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i][g]), _mm256_extractf128_ps(acc[i][g], 1));
      const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
      dot[i][g] = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
    }
}
#endif

// The G dot products of G query rows with one key row kr (contiguous), into dot[0..G) (key_dots for one key
// with AVX2).
template <int G>
static inline void group_dots(const float* qv, const float* kr, int64_t Dh, float* dot) {
#if defined(__AVX2__) && defined(__FMA__)
  key_dots<G, 1>(qv, kr, 0, Dh, reinterpret_cast<float(*)[G]>(dot));
#else
  for (int g = 0; g < G; g++) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < Dh; d++) s += qv[g * Dh + d] * kr[d];
    dot[g] = s;
  }
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// acc[g, :] += p[g * S + t] * v row t for t < seen, G query rows sharing the value rows: 32 features at a time
// held in registers across the keys (4G independent FMA chains, no load and store of acc per key). Each
// feature's sum runs over t in order with one FMA per key, as the plain loop's contracted `+= pt * vr[d]`.
template <int G>
static void pv_sums(const float* p, int64_t S, int64_t seen, const float* vb, int64_t vs, int64_t Dh, float* acc) {
  for (int64_t d0 = 0; d0 < Dh; d0 += 32) {
    __m256 a[G][4];
    for (int g = 0; g < G; g++)
      for (int j = 0; j < 4; j++) a[g][j] = _mm256_loadu_ps(acc + g * Dh + d0 + 8 * j);
    for (int64_t t = 0; t < seen; t++) {
      const float* vr = vb + t * vs + d0;
      __m256 vv[4];
      for (int j = 0; j < 4; j++) vv[j] = _mm256_loadu_ps(vr + 8 * j);
      for (int g = 0; g < G; g++) {
        const __m256 pt = _mm256_set1_ps(p[g * S + t]);
        for (int j = 0; j < 4; j++) a[g][j] = _mm256_fmadd_ps(pt, vv[j], a[g][j]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc + g * Dh + d0 + 8 * j, a[g][j]);
  }
}
#endif

// Scores of `group` query rows against keys [0, seen): p[g * S + t], and each row's maximum in mx[g].
static void group_scores(const float* qv, const View4& k, const float* kb, int64_t group, int64_t seen, int64_t S,
                         int64_t Dh, float* p, float* mx) {
  float dot[8];
  auto run = [&](auto Gc) {
    constexpr int G = decltype(Gc)::value;
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    constexpr int KB = G <= 2 ? 4 : G == 4 ? 2 : 1;  // keys at once: KB x G accumulators in registers
    if constexpr (KB > 1) {
      float dots[KB][G];
      for (; t + KB <= seen; t += KB) {
        key_dots<G, KB>(qv, kb + t * k.strides[2], k.strides[2], Dh, dots);
        for (int i = 0; i < KB; i++)
          for (int g = 0; g < G; g++) {
            p[g * S + t + i] = dots[i][g];
            mx[g] = std::max(mx[g], dots[i][g]);
          }
      }
    }
#endif
    for (; t < seen; t++) {
      group_dots<G>(qv, kb + t * k.strides[2], Dh, dot);
      for (int g = 0; g < G; g++) {
        p[g * S + t] = dot[g];
        mx[g] = std::max(mx[g], dot[g]);
      }
    }
  };
  if (k.strides[3] == 1 && Dh % 8 == 0 && group == 8) return run(std::integral_constant<int, 8>{});
  if (k.strides[3] == 1 && Dh % 8 == 0 && group == 4) return run(std::integral_constant<int, 4>{});
  if (k.strides[3] == 1 && Dh % 8 == 0 && group == 2) return run(std::integral_constant<int, 2>{});
  if (k.strides[3] == 1 && Dh % 8 == 0 && group == 1) return run(std::integral_constant<int, 1>{});
  for (int64_t t = 0; t < seen; t++) {  // any other group or layout
    const float* kr = kb + t * k.strides[2];
    for (int64_t g = 0; g < group; g++) {
      float s = 0.f;
      for (int64_t d = 0; d < Dh; d++) s += qv[g * Dh + d] * kr[d * k.strides[3]];
      p[g * S + t] = s;
      mx[g] = std::max(mx[g], s);
    }
  }
}

void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* out) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * D;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; i++) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / (float)D + eps);
    float* o = out + r * D;
    for (int64_t i = 0; i < D; i++) o[i] = xr[i] * inv * w[i];
  }
}

void rope(const View4& x, int dims, bool traditional, float base, float scale, int64_t offset, float* out,
          const int32_t* offsets) {
  const int64_t B = x.shape[0], H = x.shape[1], L = x.shape[2], Dh = x.shape[3];
  const int half = dims / 2;
  std::vector<float> cosv(L * half), sinv(L * half);
  const float lb = std::log(base) / (float)half;
  std::vector<float> freq(half);
  for (int i = 0; i < half; i++) freq[i] = std::exp(-(float)i * lb);
  auto table = [&](int64_t at) {  // cos and sin at positions at .. at + L - 1
    for (int64_t l = 0; l < L; l++) {
      const float pos = (float)(at + l) * scale;
      for (int i = 0; i < half; i++) {
        const float theta = pos * freq[i];
        cosv[l * half + i] = std::cos(theta);
        sinv[l * half + i] = std::sin(theta);
      }
    }
  };
  int64_t tabled = offsets ? offsets[0] : offset;
  table(tabled);
  const int64_t* s = x.strides;
  float* o = out;
  for (int64_t b = 0; b < B; b++) {
    if (offsets && offsets[b] != tabled) table(tabled = offsets[b]);
    for (int64_t h = 0; h < H; h++)
      for (int64_t l = 0; l < L; l++, o += Dh) {
        const float* xr = x.data + b * s[0] + h * s[1] + l * s[2];
        const float* c = cosv.data() + l * half;
        const float* sn = sinv.data() + l * half;
        const int64_t sd = s[3];
        if (traditional) {
          for (int i = 0; i < half; i++) {
            const float x1 = xr[2 * i * sd], x2 = xr[(2 * i + 1) * sd];
            o[2 * i] = x1 * c[i] - x2 * sn[i];
            o[2 * i + 1] = x1 * sn[i] + x2 * c[i];
          }
        } else {
          for (int i = 0; i < half; i++) {
            const float x1 = xr[i * sd], x2 = xr[(i + half) * sd];
            o[i] = x1 * c[i] - x2 * sn[i];
            o[i + half] = x1 * sn[i] + x2 * c[i];
          }
        }
        for (int64_t d = dims; d < Dh; d++) o[d] = xr[d * sd];
      }
  }
}

void attention(const View4& q, const View4& k, const View4& v, float scale, bool causal, float* out,
               const int32_t* starts) {
  const int64_t B = q.shape[0], Hq = q.shape[1], L = q.shape[2], Dh = q.shape[3];
  const int64_t Hkv = k.shape[1], Sk = k.shape[2], group = Hq / Hkv;
  // tasks: (sequence, KV head, block of QB queries), the group query heads sharing that KV head together, so
  // each key and value row is read once for all of them; a prompt's or a batch's run on the prompt threads
  const int64_t QB = 16, blocks = (L + QB - 1) / QB;
  parallel_for(B * Hkv * blocks, [&](int64_t task) {
    const int64_t b = task / (Hkv * blocks), kh = task / blocks % Hkv, l0 = task % blocks * QB;
    const int64_t first = starts ? std::clamp<int64_t>(starts[b], 0, Sk - 1) : 0, S = Sk - first;  // its keys
    std::vector<float> p(group * S), qv(group * Dh), acc(group * Dh), mx(group), sum(group);
    const float* kb = k.data + b * k.strides[0] + kh * k.strides[1] + first * k.strides[2];
    const float* vb = v.data + b * v.strides[0] + kh * v.strides[1] + first * v.strides[2];
    for (int64_t l = l0; l < std::min(L, l0 + QB); l++) {
      const int64_t seen = causal ? std::min(S, S - L + l + 1) : S;  // keys this query attends to
      for (int64_t g = 0; g < group; g++) {
        const float* qr = q.data + b * q.strides[0] + (kh * group + g) * q.strides[1] + l * q.strides[2];
        for (int64_t d = 0; d < Dh; d++) qv[g * Dh + d] = qr[d * q.strides[3]] * scale;
        mx[g] = -INFINITY;
      }
      group_scores(qv.data(), k, kb, group, seen, S, Dh, p.data(), mx.data());
      for (int64_t g = 0; g < group; g++) {
        float* pg = p.data() + g * S;
        const float m = mx[g];
        for (int64_t t = 0; t < seen; t++) pg[t] -= m;
        exp_mlx(pg, pg, seen);  // MLX's own exp (as its softmax computes it on the CPU)
        float total = 0.f;
        for (int64_t t = 0; t < seen; t++) total += pg[t];  // in order
        sum[g] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__AVX2__) && defined(__FMA__)
      if (v.strides[3] == 1 && Dh % 32 == 0 && (group == 1 || group == 2 || group == 4)) {
        (group == 1 ? pv_sums<1> : group == 2 ? pv_sums<2> : pv_sums<4>)(p.data(), S, seen, vb, v.strides[2], Dh,
                                                                          acc.data());
      } else
#endif
      for (int64_t t = 0; t < seen; t++) {
        const float* vr = vb + t * v.strides[2];
        for (int64_t g = 0; g < group; g++) {
          const float pt = p[g * S + t];
          float* ag = acc.data() + g * Dh;
          if (v.strides[3] == 1) {
#pragma omp simd
            for (int64_t d = 0; d < Dh; d++) ag[d] += pt * vr[d];
          } else
            for (int64_t d = 0; d < Dh; d++) ag[d] += pt * vr[d * v.strides[3]];
        }
      }
      for (int64_t g = 0; g < group; g++) {
        float* o = out + ((b * Hq + kh * group + g) * L + l) * Dh;
        const float inv = 1.f / sum[g];
        for (int64_t d = 0; d < Dh; d++) o[d] = acc[g * Dh + d] * inv;
      }
    }
  }, spread(B * L));
}

void swiglu(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#if defined(EDGE0_LANES_BUILT)
  for (const auto one = splat(1.f); i + EXP_LANES <= n; i += EXP_LANES) {
    const auto gv = load_lanes(g + i);
    store_lanes(g + i, mul_lanes(div_lanes(gv, add_lanes(one, exp_lanes(neg_lanes(gv)))), load_lanes(u + i)));
  }
#endif
  for (; i < n; i++) g[i] = g[i] / (1.f + exp1(-g[i])) * u[i];
}

void softmax_topk(const float* logits, int64_t T, int64_t E, int k, bool norm, uint32_t* inds, float* scores,
                  const uint32_t* among, int64_t M) {
  std::vector<float> p(E);
  std::vector<uint32_t> order(E);
  std::vector<char> in(among ? E : 0);
  for (int64_t t = 0; t < T; t++) {
    const float* l = logits + t * E;
    const float mx = *std::max_element(l, l + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; e++) sum += (p[e] = std::exp(l[e] - mx));
    int64_t n = 0;
    if (among) {  // the row's distinct candidates, in id order (the tie rule below needs no other)
      std::fill(in.begin(), in.end(), 0);
      for (int64_t j = 0; j < M; j++)
        if (among[t * M + j] < E) in[among[t * M + j]] = 1;
      for (int64_t e = 0; e < E; e++)
        if (in[e]) order[n++] = (uint32_t)e;
    }
    if (n < k) {  // no candidates (or fewer than k): every expert
      n = E;
      for (int64_t e = 0; e < E; e++) order[e] = (uint32_t)e;
    }
    std::partial_sort(order.begin(), order.begin() + k, order.begin() + n,
                      [&](uint32_t a, uint32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float picked = 0.f;
    for (int j = 0; j < k; j++) picked += (scores[t * k + j] = p[order[j]] / sum);
    for (int j = 0; j < k; j++) {
      inds[t * k + j] = order[j];
      if (norm) scores[t * k + j] /= picked;
    }
  }
}

void embed(const int64_t* ids, int64_t n, const uint32_t* w, const float* scales, const float* biases, int64_t V,
           int64_t D, int gs, int bits, float* out) {
  const int per = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  const int64_t words = D / per, G = D / gs;
  for (int64_t i = 0; i < n; i++) {
    float* o = out + i * D;
    const int64_t id = ids[i];
    if (id < 0 || id >= V) {
      std::fill(o, o + D, 0.f);
      continue;
    }
    const uint32_t* row = w + id * words;
    for (int64_t g = 0; g < G; g++) {
      const float s = scales[id * G + g], b = biases[id * G + g];
      for (int64_t j = g * gs; j < (g + 1) * gs; j++) {
        const float q = (float)((row[j / per] >> (bits * (j % per))) & mask);
        volatile float p = q * s;  // rounded before the sum, as mx.dequantize (no fused multiply-add)
        o[j] = p + b;
      }
    }
  }
}

void log_softmax(const float* x, int64_t rows, int64_t D, float* out) {
  std::vector<float> e(D);
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * D;
    float m = -INFINITY;
    for (int64_t i = 0; i < D; i++) m = std::max(m, xr[i]);
    for (int64_t i = 0; i < D; i++) e[i] = xr[i] - m;
    exp_mlx(e.data(), e.data(), D);
    float sum = 0.f;  // in order, one at a time: MLX's sum over Simd<float, 1>
    for (int64_t i = 0; i < D; i++) sum += e[i];
    const float lse = std::isinf(m) ? m : std::log(sum) + m;
    for (int64_t i = 0; i < D; i++) out[r * D + i] = xr[i] - lse;
  }
}

void combine(const float* y, const float* scores, int64_t T, int k, int64_t D, float* out) {
  for (int64_t t = 0; t < T; t++) {
    float* o = out + t * D;
    std::fill(o, o + D, 0.f);
    for (int j = 0; j < k; j++) {
      const float sc = scores[t * k + j];
      const float* yr = y + (t * k + j) * D;
      for (int64_t d = 0; d < D; d++) o[d] += sc * yr[d];
    }
  }
}

// The sum of a[i] * b[i], i < D, in 16 lanes (i mod 16) added in order, then the lanes in a fixed tree: the same
// bits for a row whatever else is computed beside it (and, for bfloat16 weights, the bits of their float32 values).
template <typename W>
static float dot16(const float* a, const W* b, int64_t D) {
  float lane[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
#pragma omp simd
    for (int j = 0; j < 16; j++) lane[j] += a[i + j] * wval(b, i + j);
  }
  for (int j = 0; i + j < D; j++) lane[j] += a[i + j] * wval(b, i + j);
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; j++) lane[j] += lane[j + w];
  return lane[0];
}

// dot16 of a against 4 rows of b (b, b + D, ...) at once: 4 independent sums (a single one waits on its own
// additions), each with exactly dot16's operations in dot16's order, so each result has dot16's bits.
template <typename W>
static void dot16x4(const float* a, const W* b, int64_t D, float* out) {
  float lane[4][16] = {};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    // the next 4 rows (a matrix's rows lie one after another), asked for while these are summed: a head's weights
    // come from L3 at each step (a prefetch changes no sum)
    for (int o = 0; o < 4; o++) __builtin_prefetch(b + (4 + o) * D + i);
    for (int o = 0; o < 4; o++) {
#pragma omp simd
      for (int j = 0; j < 16; j++) lane[o][j] += a[i + j] * wval(b, o * D + i + j);
    }
  }
  for (int o = 0; o < 4; o++) {
    for (int j = 0; i + j < D; j++) lane[o][j] += a[i + j] * wval(b, o * D + i + j);
    for (int w = 8; w >= 1; w /= 2)
      for (int j = 0; j < w; j++) lane[o][j] += lane[o][j + w];
    out[o] = lane[o][0];
  }
}

#if defined(__AVX512F__) && defined(__FMA__)
// dot16x4 for bfloat16 weights with AVX-512: 16 weights widened in a register (zero-extend, shift into the high
// half) and one FMA a lane, as the float32 loop compiles (-march: contracted to FMA), so the float32 loop's bits
// for the widened values (tested).
template <>
void dot16x4<uint16_t>(const float* a, const uint16_t* b, int64_t D, float* out) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    for (int o = 0; o < 4; o++) __builtin_prefetch(b + (4 + o) * D + i);
    const __m512 av = _mm512_loadu_ps(a + i);
    for (int o = 0; o < 4; o++) {
      acc[o] = _mm512_fmadd_ps(av, wide16(b + o * D + i), acc[o]);
    }
  }
  for (int o = 0; o < 4; o++) {
    float lane[16];
    _mm512_storeu_ps(lane, acc[o]);
    for (int j = 0; i + j < D; j++) lane[j] += a[i + j] * wval(b, o * D + i + j);
    for (int w = 8; w >= 1; w /= 2)
      for (int j = 0; j < w; j++) lane[j] += lane[j + w];
    out[o] = lane[0];
  }
}
#endif

#if defined(__AVX512F__) && defined(__FMA__)
// The sum of v's 16 lanes in dot16's tree (lane j += lane j + w for w = 8, 4, 2, 1: the same additions in the same
// association), with shuffles in registers instead of a store and 15 scalar additions.
static inline float tree16(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 2, 3, 2)));  // lanes 0-7 += lanes 8-15
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 1, 1, 1)));  // lanes 0-3 += lanes 4-7
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(3, 2, 3, 2)));  // lanes 0-1 += lanes 2-3
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 1, 1, 1)));  // lane 0 += lane 1
  return _mm512_cvtss_f32(v);
}

// dot16 of a against 16 rows of b at once, D a multiple of 16 (one sequence's head linears): 16 independent FMA
// chains (4 keep the FMA unit waiting on its latency), each with dot16's operations in its order, so each result has
// dot16's bits.
template <typename W>
static void dot16x16(const float* a, const W* b, int64_t D, float* out) {
  __m512 acc[16];
  for (int o = 0; o < 16; o++) acc[o] = _mm512_setzero_ps();
  constexpr int64_t LINE = 64 / sizeof(W);  // weights a cache line holds
  for (int64_t i = 0; i < D; i += 16) {
    // the next 16 rows' line at i, asked for while these are summed: a step's heads come from L3 (node_cost, 4 runs
    // against a build without it: the head from L3 31.8 against 33.2 us, medians)
    if (i % LINE == 0)
      for (int o = 0; o < 16; o++) __builtin_prefetch(b + (16 + o) * D + i);
    const __m512 av = _mm512_loadu_ps(a + i);
    for (int o = 0; o < 16; o++) acc[o] = _mm512_fmadd_ps(av, wide16(b + o * D + i), acc[o]);
  }
  for (int o = 0; o < 16; o++) out[o] = tree16(acc[o]);
}
#endif

#if defined(__AVX512F__) && defined(__FMA__)
// dot16x4 for R rows of a (a, a + D, ...) at once, out[r * 4 + o]: each 16-weight load (widened once) serves the R
// rows, and each of the R x 4 sums has dot16x4's operations in its order (one FMA a lane per 16 inputs, the tail's
// lanes, the fixed tree), so each has the bits it gets alone.
template <int R, typename W>
static void dot16x4_rows(const float* a, const W* b, int64_t D, float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; r++)
    for (int o = 0; o < 4; o++) acc[r][o] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    for (int o = 0; o < 4; o++) __builtin_prefetch(b + (4 + o) * D + i);
    __m512 wv[4];
    for (int o = 0; o < 4; o++) wv[o] = wide16(b + o * D + i);
    for (int r = 0; r < R; r++) {
      const __m512 av = _mm512_loadu_ps(a + r * D + i);
      for (int o = 0; o < 4; o++) acc[r][o] = _mm512_fmadd_ps(av, wv[o], acc[r][o]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int o = 0; o < 4; o++) {
      if (i == D) {  // no tail: the tree in registers
        out[r * 4 + o] = tree16(acc[r][o]);
        continue;
      }
      float lane[16];
      _mm512_storeu_ps(lane, acc[r][o]);
      for (int j = 0; i + j < D; j++) lane[j] += a[r * D + i + j] * wval(b, o * D + i + j);
      for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) lane[j] += lane[j + w];
      out[r * 4 + o] = lane[0];
    }
}
#endif

template <typename W>
static void linear_rows(const float* x, int64_t rows, const W* w, const float* bias, int64_t N, int64_t D, float* out) {
  const int64_t NB = 16;  // outputs per task
  parallel_for((N + NB - 1) / NB, [&](int64_t t) {
    const int64_t n1 = std::min(N, (t + 1) * NB);
    int64_t r = 0;
#if defined(__AVX512F__) && defined(__FMA__)
    // several rows (a served batch's heads): 4 rows x 4 outputs at a time, each weight load for all 4 rows
    for (; r + 4 <= rows; r += 4) {
      int64_t n = t * NB;
      for (float v[16]; n + 4 <= n1; n += 4) {
        dot16x4_rows<4>(x + r * D, w + n * D, D, v);
        for (int i = 0; i < 4; i++)
          for (int o = 0; o < 4; o++) out[(r + i) * N + n + o] = v[i * 4 + o] + (bias ? bias[n + o] : 0.f);
      }
      for (; n < n1; n++)
        for (int i = 0; i < 4; i++) out[(r + i) * N + n] = dot16(x + (r + i) * D, w + n * D, D) + (bias ? bias[n] : 0.f);
    }
#endif
    for (; r < rows; r++) {
      int64_t n = t * NB;
#if defined(__AVX512F__) && defined(__FMA__)
      if (D % 16 == 0)
        for (float v[16]; n + 16 <= n1; n += 16) {
          dot16x16(x + r * D, w + n * D, D, v);
          for (int o = 0; o < 16; o++) out[r * N + n + o] = v[o] + (bias ? bias[n + o] : 0.f);
        }
#endif
      for (float v[4]; n + 4 <= n1; n += 4) {
        dot16x4(x + r * D, w + n * D, D, v);
        for (int o = 0; o < 4; o++) out[r * N + n + o] = v[o] + (bias ? bias[n + o] : 0.f);
      }
      for (; n < n1; n++) out[r * N + n] = dot16(x + r * D, w + n * D, D) + (bias ? bias[n] : 0.f);
    }
  }, spread(rows));
}

void linear(const float* x, int64_t rows, const float* w, const float* bias, int64_t N, int64_t D, float* out) {
  linear_rows(x, rows, w, bias, N, D, out);
}
void linear(const float* x, int64_t rows, const uint16_t* w, const float* bias, int64_t N, int64_t D, float* out) {
  linear_rows(x, rows, w, bias, N, D, out);
}

template <typename W>
static void head_rows(const float* x, const uint32_t* now, const uint32_t* prev, int64_t rows, int k, int64_t D,
                      int64_t E, const float* router, const W* delta, const W* w1, const float* b1, int64_t H,
                      const W* w2, const float* b2, int64_t N, float* out) {
  const int64_t F = D + 2 * E;
  std::vector<float> f(rows * F, 0.f), g(rows * H), d(rows * N), o2(rows * N);
  for (int64_t r = 0; r < rows; r++) {
    float* fr = f.data() + r * F;
    std::copy(x + r * D, x + (r + 1) * D, fr);
    for (int j = 0; j < k; j++) {
      if (now[r * k + j] < E) fr[D + now[r * k + j]] = 1.f;
      if (prev && prev[r * k + j] < E) fr[D + E + prev[r * k + j]] = 1.f;
    }
  }
  linear_rows(f.data(), rows, w1, b1, H, F, g.data());
  float* gv = g.data();
  std::vector<float> e(rows * H);  // mlx.nn.gelu: x * (1 + erf(x / sqrt(2))) / 2
  for (int64_t i = 0; i < rows * H; i++) e[i] = gv[i] / 1.41421356f;
  erf_mlx(e.data(), e.data(), rows * H);
  for (int64_t i = 0; i < rows * H; i++) gv[i] = gv[i] * (1.f + e[i]) / 2.f;
  linear_rows(f.data(), rows, delta, nullptr, N, F, d.data());
  linear_rows(g.data(), rows, w2, b2, N, H, o2.data());
  for (int64_t i = 0; i < rows * N; i++) out[i] = router[i] + d[i] + o2[i];
}


void head(const float* x, const uint32_t* now, const uint32_t* prev, int64_t rows, int k, int64_t D, int64_t E,
          const float* router, const float* delta, const float* w1, const float* b1, int64_t H, const float* w2,
          const float* b2, int64_t N, float* out) {
  head_rows(x, now, prev, rows, k, D, E, router, delta, w1, b1, H, w2, b2, N, out);
}
void head(const float* x, const uint32_t* now, const uint32_t* prev, int64_t rows, int k, int64_t D, int64_t E,
          const float* router, const uint16_t* delta, const uint16_t* w1, const float* b1, int64_t H,
          const uint16_t* w2, const float* b2, int64_t N, float* out) {
  head_rows(x, now, prev, rows, k, D, E, router, delta, w1, b1, H, w2, b2, N, out);
}

#if defined(__AVX512F__) && defined(__FMA__)
// y[i] += scale * (x[i] A) B for ROWS rows of x (D each) and y (N each), A (D, 16), B (16, N): adapt_w's loop
// for rank 16, its operations in its order for each row (t's lanes one FMA a feature of x, then
// each output one FMA a rank in order), so each row has the bits it has alone; A's and B's loads serve every row,
// and the rows' FMA chains run side by side. A and B as float32 or as bfloat16 bits (W uint16_t: widened exactly,
// so the bits of their float32 widening).
template <int ROWS, typename W>
static void adapt_rows(const float* x, int64_t D, const W* a, const W* b, int64_t N, float scale, float* y) {
  __m512 t[ROWS];
  for (int i = 0; i < ROWS; i++) t[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d++) {
    const __m512 ad = wide16(a + d * 16);
    for (int i = 0; i < ROWS; i++) t[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * D + d]), ad, t[i]);
  }
  alignas(64) float ts[ROWS][16];
  for (int i = 0; i < ROWS; i++) _mm512_store_ps(ts[i], _mm512_mul_ps(_mm512_set1_ps(scale), t[i]));
  for (int64_t n0 = 0; n0 < N; n0 += 16) {
    __m512 acc[ROWS];
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_loadu_ps(y + i * N + n0);
    for (int j = 0; j < 16; j++) {
      const __m512 bj = wide16(b + j * N + n0);
      for (int i = 0; i < ROWS; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(ts[i][j]), bj, acc[i]);
    }
    for (int i = 0; i < ROWS; i++) _mm512_storeu_ps(y + i * N + n0, acc[i]);
  }
}
#endif

template <typename W>
static void adapt_w(const float* xd, int64_t R, int64_t D, const W* a, const W* b, int64_t N, int64_t r, float scale,
                    float* y) {
#if defined(__AVX512F__) && defined(__FMA__)
  if (r == 16 && N % 16 == 0) {  // the adapters' rank: each row's t in one register, 4 rows a task
    parallel_for((R + 3) / 4, [&](int64_t task) {
      const int64_t r0 = task * 4, n = std::min<int64_t>(4, R - r0);
      (n == 4 ? adapt_rows<4, W> : n == 3 ? adapt_rows<3, W> : n == 2 ? adapt_rows<2, W> : adapt_rows<1, W>)(
          xd + r0 * D, D, a, b, N, scale, y + r0 * N);
    }, spread(R));
    return;
  }
#endif
  parallel_for(R, [&](int64_t row) {
    std::vector<float> t(r, 0.f);
    const float* xr = xd + row * D;
    for (int64_t d = 0; d < D; d++) {
      const float xv = xr[d];
      const W* ad = a + d * r;
      for (int64_t j = 0; j < r; j++) t[j] += xv * wval(ad, j);
    }
    float* yr = y + row * N;
    for (int64_t j = 0; j < r; j++) {
      const float tj = scale * t[j];
      const W* bj = b + j * N;
      for (int64_t n = 0; n < N; n++) yr[n] += tj * wval(bj, n);
    }
  }, spread(R));
}

void adapt(const float* xd, int64_t R, int64_t D, const float* a, const float* b, int64_t N, int64_t r, float scale,
           float* y) {
  adapt_w(xd, R, D, a, b, N, r, scale, y);
}
void adapt(const float* xd, int64_t R, int64_t D, const uint16_t* a, const uint16_t* b, int64_t N, int64_t r,
           float scale, float* y) {
  adapt_w(xd, R, D, a, b, N, r, scale, y);
}

// This build's table (dense_ops.h), named for the instruction set its #if paths were built for.
const DenseOps ops = {
#if defined(__AVX512F__) && defined(__FMA__)
    "avx512",
#elif defined(__AVX2__) && defined(__FMA__)
    "avx2",
#else
    "portable",
#endif
    rms_norm, log_softmax, rope, attention, softmax_topk, linear, linear, head, head, exp_mlx, erf_mlx, swiglu, embed,
    combine, adapt, adapt};

}  // namespace EDGE0_DENSE_NS
}  // namespace edge0
