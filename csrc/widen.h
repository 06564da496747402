// 16 float32 lanes from weights stored as float32 or as bfloat16 bits (widened exactly: a bfloat16 is the high half
// of its float32), for the AVX-512 paths of qmv.cpp and dense.cpp.
#pragma once

#include <cstdint>

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
