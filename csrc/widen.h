// Weights stored as float32 or as bfloat16 bits, as float32 (widened exactly: a bfloat16 is the high half of its
// float32): one value (`wval`, every path), or 16 lanes (`wide16`, the AVX-512 paths of qmv.cpp and dense.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace edge0 {

static inline float wval(const float* p, int64_t i) { return p[i]; }
static inline float wval(const uint16_t* p, int64_t i) {
  const uint32_t u = (uint32_t)p[i] << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace edge0

#if defined(__AVX512F__)
#include <immintrin.h>

namespace edge0 {

static inline __m512 widen16(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}
static inline __m512 wide16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 wide16(const uint16_t* p) { return widen16(_mm256_loadu_si256((const __m256i*)p)); }

}  // namespace edge0
#endif
