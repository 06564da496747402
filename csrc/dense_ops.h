// One build of dense.cpp as a table of its functions: CMakeLists.txt compiles dense.cpp once per instruction set, each
// build into a namespace of its own (native: -march's own; avx2: without AVX-512; portable: without AVX), and
// dense_impl.cpp's functions of dense.h call the table chosen.
#pragma once

#include "dense.h"

namespace edge0 {

struct DenseOps {
  const char* name;  // "avx512", "avx2" or "portable": the instructions its #if paths were built for
  void (*rms_norm)(const float*, const float*, float, int64_t, int64_t, float*);
  void (*log_softmax)(const float*, int64_t, int64_t, float*);
  void (*rope)(const View4&, int, bool, float, float, int64_t, float*, const int32_t*);
  void (*attention)(const View4&, const View4&, const View4&, float, bool, float*, const int32_t*);
  void (*softmax_topk)(const float*, int64_t, int64_t, int, bool, uint32_t*, float*, const uint32_t*, int64_t);
  void (*linear)(const float*, int64_t, const float*, const float*, int64_t, int64_t, float*);
  void (*linear16)(const float*, int64_t, const uint16_t*, const float*, int64_t, int64_t, float*);
  void (*head)(const float*, const uint32_t*, const uint32_t*, int64_t, int, int64_t, int64_t, const float*,
               const float*, const float*, const float*, int64_t, const float*, const float*, int64_t, float*);
  void (*head16)(const float*, const uint32_t*, const uint32_t*, int64_t, int, int64_t, int64_t, const float*,
                 const uint16_t*, const uint16_t*, const float*, int64_t, const uint16_t*, const float*, int64_t,
                 float*);
  void (*exp_mlx)(const float*, float*, int64_t);
  void (*erf_mlx)(const float*, float*, int64_t);
  void (*swiglu)(float*, const float*, int64_t);
  void (*embed)(const int64_t*, int64_t, const uint32_t*, const float*, const float*, int64_t, int64_t, int, int,
                float*);
  void (*combine)(const float*, const float*, int64_t, int, int64_t, float*);
  void (*adapt)(const float*, int64_t, int64_t, const float*, const float*, int64_t, int64_t, float, float*);
  void (*adapt16)(const float*, int64_t, int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t, float, float*);
};

// The builds' tables (those CMakeLists.txt made: EDGE0_DENSE_AVX2, EDGE0_DENSE_PORTABLE).
namespace native {
extern const DenseOps ops;
}
namespace avx2 {
extern const DenseOps ops;
}
namespace portable {
extern const DenseOps ops;
}

}  // namespace edge0
