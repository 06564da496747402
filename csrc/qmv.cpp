// 4-bit affine quantized matrix-vector products: an AVX-512 VNNI path (int8 activations per group,
// nibble dot products with vpdpbusd, 128 weights per instruction pair), an AVX2 path (the same with
// vpmaddubsw/vpmaddwd, as llama.cpp does) and a plain C++ path for other CPUs.
// Shapes: E experts, N outputs, D inputs, G = D/gs groups, P (x row, expert, out row) pairs.

#include "qmv.h"
#include "widen.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#define EDGE0_AVX2 1
#endif
#if defined(EDGE0_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define EDGE0_VNNI 1
#endif

namespace edge0 {

// How long a worker spins for the next job before it sleeps: a decode step's products come every few
// tens of microseconds, and a sleeping worker costs a wake-up (tens of microseconds on a VM) each.
static int64_t spin_ns() {
  static const int64_t ns = [] {
    const char* e = std::getenv("EDGE0_KERNEL_SPIN_US");
    return (e ? std::atoll(e) : 1000) * 1000;
  }();
  return ns;
}

// How far ahead of the bytes a dot product reads its weights are asked for (_mm_prefetch): a row is D/2
// bytes, so 2 KiB is 2 rows of D 2048. The hardware prefetcher stops at 4 KiB pages, and a decode step
// streams every weight once from memory (`edge0 bench --kernels` measures the gain). A prefetch changes no
// arithmetic: outputs are the same.
constexpr int64_t PREFETCH_BYTES = 2048;

// ---------------------------------------------------------------------------------------------
// A persistent pool: the caller and n-1 workers claim tasks from one counter. The job generation
// lives in the counter's high bits, so a worker that wakes late can never run a finished job's task.

#if defined(__linux__)
// The cores thread t may run on: `cpus` (empty: every core the process may use).
static void set_cpus(pthread_t t, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  if (cpus.empty())
    for (int c = 0; c < CPU_SETSIZE; c++) CPU_SET(c, &set);
  pthread_setaffinity_np(t, sizeof set, &set);
}

static std::vector<int> cpus_of(pthread_t t) {
  std::vector<int> out;
  cpu_set_t set;
  if (pthread_getaffinity_np(t, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; c++)
      if (CPU_ISSET(c, &set)) out.push_back(c);
  return out;
}
#endif

class Pool {
 public:
  ~Pool() { resize(1); }

  void resize(int n) {
    n = std::max(1, n);
    std::lock_guard<std::mutex> one(run_mu_);  // never while a job runs
    if (n == threads()) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_ = false;
    for (int i = 1; i < n; i++) workers_.emplace_back([this, i] { loop(i - 1); });
#if defined(__linux__)
    if (!cpus_.empty())
      for (auto& t : workers_) set_cpus(t.native_handle(), cpus_);
#endif
  }

  int threads() const { return 1 + (int)workers_.size(); }

  // The cores the workers may run on (empty: any), kept for workers made later.
  void place(const std::vector<int>& cpus) {
    std::lock_guard<std::mutex> one(run_mu_);
    cpus_ = cpus;
#if defined(__linux__)
    for (auto& t : workers_) set_cpus(t.native_handle(), cpus);
#endif
  }

  // The cores the first worker may run on (empty where there is none).
  std::vector<int> placed() {
    std::lock_guard<std::mutex> one(run_mu_);
#if defined(__linux__)
    if (!workers_.empty()) return cpus_of(workers_[0].native_handle());
#endif
    return {};
  }

  // fn(i) for i in [0, n) on `want` threads at most (the caller and want - 1 workers); serial on the
  // caller, waking no worker, when want or n is 1.
  void run(int64_t n, const std::function<void(int64_t)>& fn, int want) {
    if (workers_.empty() || n <= 1 || want <= 1) {
      for (int64_t i = 0; i < n; i++) fn(i);
      return;
    }
    std::lock_guard<std::mutex> one(run_mu_);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen = (gen_.load(std::memory_order_relaxed) + 1) & 0xffffffffu;
      fn_ = &fn;
      ntask_ = n;
      helpers_ = want - 1;
      done_.store(0, std::memory_order_relaxed);
      next_.store(gen << 32, std::memory_order_release);
      gen_.store(gen, std::memory_order_release);
    }
    cv_.notify_all();
    work(gen, &fn, n);
    while (done_.load(std::memory_order_acquire) < n) {
#if defined(EDGE0_AVX2)
      _mm_pause();
#else
      std::this_thread::yield();
#endif
    }
  }

 private:
  void work(uint64_t gen, const std::function<void(int64_t)>* fn, int64_t n) {
    for (;;) {
      uint64_t v = next_.load(std::memory_order_acquire);
      if ((v >> 32) != gen || (int64_t)(v & 0xffffffffu) >= n) return;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      (*fn)((int64_t)(v & 0xffffffffu));
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void loop(int index) {
    uint64_t seen = gen_.load();
    for (;;) {
      // spin briefly: decode calls come back to back, and a sleeping worker costs a wake-up each. The spin
      // yields its core at every turn: under overlapped decode the graph-building thread runs between
      // products, and a worker that held the core with pause loops took it from that thread.
      const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns());
      for (int i = 0; gen_.load(std::memory_order_acquire) == seen; i++) {
        if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) break;
        std::this_thread::yield();
      }
      const std::function<void(int64_t)>* fn;
      int64_t n;
      uint64_t gen;
      bool helps;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || gen_.load() != seen; });
        if (stop_) return;
        gen = seen = gen_.load();
        fn = fn_;
        n = ntask_;
        helps = index < helpers_;
      }
      if (helps) work(gen, fn, n);
    }
  }

  std::vector<std::thread> workers_;
  std::vector<int> cpus_;  // where workers run (empty: anywhere)
  std::mutex mu_, run_mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<uint64_t> gen_{0};
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t ntask_ = 0;
  int helpers_ = 0;  // workers the running job may use
};

static Pool& pool() {
  static Pool p;
  return p;
}

static std::atomic<int> decode_threads{1}, prompt_threads_{1};

void set_num_threads(int n, int prompt) {
  n = std::max(1, n);
  prompt = prompt > 0 ? prompt : n;
  pool().resize(std::max(n, prompt));
  decode_threads.store(n);
  prompt_threads_.store(prompt);
}

void place_workers(const std::vector<int>& cpus) { pool().place(cpus); }
std::vector<int> worker_cpus() { return pool().placed(); }

void set_this_thread_cpus(const std::vector<int>& cpus) {
#if defined(__linux__)
  set_cpus(pthread_self(), cpus);
#endif
}

std::vector<int> this_thread_cpus() {
#if defined(__linux__)
  return cpus_of(pthread_self());
#else
  return {};
#endif
}

int num_threads() { return decode_threads.load(); }
int prompt_threads() { return prompt_threads_.load(); }

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, bool prompt) {
  pool().run(n, fn, prompt ? prompt_threads_.load() : decode_threads.load());
}

// The code path: 0 portable, 1 AVX2, 2 AVX-512 VNNI; the best one built is the default.
enum Impl { PORTABLE = 0, AVX2 = 1, VNNI = 2 };
#if defined(EDGE0_VNNI)
static constexpr int BEST = VNNI;
#elif defined(EDGE0_AVX2)
static constexpr int BEST = AVX2;
#else
static constexpr int BEST = PORTABLE;
#endif
static std::atomic<int> use_impl{BEST};
static const char* const IMPL_NAMES[] = {"portable", "avx2", "avx512"};

const char* impl() { return IMPL_NAMES[use_impl.load()]; }

static std::atomic<bool> use_packed{true};
void set_packed(bool on) { use_packed.store(on); }
bool packed_on() { return use_packed.load(); }

std::vector<std::string> impls() { return std::vector<std::string>(IMPL_NAMES, IMPL_NAMES + BEST + 1); }

bool set_impl(const char* name) {
  for (int i = 0; i <= BEST; i++) {
    if (std::strcmp(name, IMPL_NAMES[i]) == 0) {
      use_impl = i;
      return true;
    }
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Activations of one call: float group sums (every path), int8 values and their scale (AVX2, VNNI).
// Byte j of a weight row holds elements 2j (low nibble) and 2j+1 (high), so the int8 values are stored
// evens first, odds after, within each chunk a weight load covers: 64 elements for AVX2 (32-byte
// loads); 128 for VNNI (64-byte loads), whose last chunk is 64 elements when D is not a multiple of 128.

struct Acts {
  std::vector<float> sums;  // (rows, G) sum of x over each group (of its int8 values, times scale, on AVX2)
  std::vector<float> scale;  // (rows, G) int8 scale per group
  std::vector<int8_t> q;  // (rows, D) permuted int8
};

// v rounded to the nearest integer, ties to even: std::lrintf's own instruction (cvtss2si under the default rounding
// mode), inline instead of a call into libm per element.
static inline int32_t round_even(float v) {
#if defined(EDGE0_AVX2)
  return _mm_cvtss_si32(_mm_set_ss(v));
#else
  return (int32_t)std::lrintf(v);
#endif
}

#if defined(EDGE0_VNNI)
// The VNNI path's int8 values of x (D a multiple of 128) for groups of gs >= 16, 16 at a time: each value rounded as
// round_even rounds it (vcvtps2dq under the default rounding mode), evens and odds of each 128-element chunk
// apart by a permute; qsum[g] the sum of group g's values.
static void quantize_vnni(const float* x, int64_t D, int gs, const float* inv, int8_t* q, int32_t* qsum) {
  // a NaN's conversion (INT_MIN) is 0 in the int8 value; in the sum too, as the scalar path sums the int8 values
  const auto to_int = [](__m512 v) {
    const __m512i i = _mm512_cvtps_epi32(v);
    return _mm512_maskz_mov_epi32(_mm512_cmpneq_epi32_mask(i, _mm512_set1_epi32(INT32_MIN)), i);
  };
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t c = 0; c < D; c += 128)
    for (int64_t j = 0; j < 64; j += 16) {  // elements c + 2j .. c + 2j + 31
      const int64_t e = c + 2 * j;
      const __m512i a = to_int(_mm512_mul_ps(_mm512_loadu_ps(x + e), _mm512_set1_ps(inv[e / gs])));
      const __m512i b = to_int(_mm512_mul_ps(_mm512_loadu_ps(x + e + 16), _mm512_set1_ps(inv[(e + 16) / gs])));
      qsum[e / gs] += _mm512_reduce_add_epi32(a);
      qsum[(e + 16) / gs] += _mm512_reduce_add_epi32(b);
      _mm_storeu_si128((__m128i*)(q + c + j), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(a, even, b)));
      _mm_storeu_si128((__m128i*)(q + c + 64 + j), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(a, odd, b)));
    }
}
#endif

static void prepare_row(const float* x, int64_t D, int gs, int impl, int bits, float* sums, float* scale, int8_t* q) {
  const int64_t G = D / gs;
  float inv[MAX_GROUPS];
  for (int64_t g = 0; g < G; g++) {
    const float* xg = x + g * gs;
    float amax = 0.f;
    for (int i = 0; i < gs; i++) amax = std::max(amax, std::fabs(xg[i]));
    if (impl == PORTABLE) {  // float activations: the group's sum of x (the other paths take their int8 values')
      float s = 0.f;
      for (int i = 0; i < gs; i++) s += xg[i];
      sums[g] = s;
    }
    scale[g] = amax / 127.f;
    inv[g] = amax > 0.f ? 127.f / amax : 0.f;
  }
  if (impl == PORTABLE) return;
  int32_t qsum[MAX_GROUPS];
  std::fill(qsum, qsum + G, 0);  // this row's groups only: zeroing all MAX_GROUPS was 16 KiB a row
  if (bits == 8) {  // a byte per weight: int8 values in their natural order
    for (int64_t i = 0; i < D; i++) {
      q[i] = (int8_t)round_even(x[i] * inv[i / gs]);
      qsum[i / gs] += q[i];
    }
  }
#if defined(EDGE0_VNNI)
  if (bits == 4 && impl == VNNI && D % 128 == 0 && gs >= 16) {
    quantize_vnni(x, D, gs, inv, q, qsum);
    bits = 0;  // done
  }
#endif
  for (int64_t c = 0; bits == 4 && c < D;) {
    const int64_t half = impl == VNNI && c + 128 <= D ? 64 : 32;  // elements per half of this chunk
    for (int64_t j = 0; j < half; j++) {
      int64_t e = c + 2 * j, o = e + 1;
      int8_t qe = (int8_t)round_even(x[e] * inv[e / gs]), qo = (int8_t)round_even(x[o] * inv[o / gs]);
      q[c + j] = qe;
      q[c + half + j] = qo;
      qsum[e / gs] += qe;
      qsum[o / gs] += qo;
    }
    c += 2 * half;
  }
  // The bias term takes the sum of the int8 values too: the product is then exactly that of the
  // dequantized weights with the rounded x, and b * sum(x) does not amplify the rounding error.
  for (int64_t g = 0; g < G; g++) sums[g] = scale[g] * (float)qsum[g];
}

// ---------------------------------------------------------------------------------------------
// Every path takes scales and biases (S) as float32 or as bfloat16 bits, widened where they are used.

// Plain C++: float activations, nibbles unpacked one byte at a time.

template <typename S>
static float dot_portable(const uint8_t* w, const S* s, const S* b, const float* x, const float* xsum, int64_t D,
                          int gs) {
  const int64_t G = D / gs;
  float acc = 0.f;
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* wg = w + g * gs / 2;
    const float* xg = x + g * gs;
    float sq = 0.f;
    for (int j = 0; j < gs / 2; j++) {
      sq += xg[2 * j] * (float)(wg[j] & 15) + xg[2 * j + 1] * (float)(wg[j] >> 4);
    }
    acc += wval(s, g) * sq + wval(b, g) * xsum[g];
  }
  return acc;
}

template <typename S>
static float dot_portable8(const uint8_t* w, const S* s, const S* b, const float* x, const float* xsum, int64_t D,
                           int gs) {
  const int64_t G = D / gs;
  float acc = 0.f;
  for (int64_t g = 0; g < G; g++) {
    float sq = 0.f;
    for (int j = 0; j < gs; j++) sq += x[g * gs + j] * (float)w[g * gs + j];
    acc += wval(s, g) * sq + wval(b, g) * xsum[g];
  }
  return acc;
}

#if defined(EDGE0_AVX2)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// 64 weights (32 bytes) against 64 permuted int8 activations: 16 int16 partial sums, the low
// 128 bits from elements 0..31, the high from 32..63 (each |sum| <= 2*2*15*127, no overflow).
static inline __m256i chunk16(const uint8_t* w, const int8_t* xq) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  __m256i v = _mm256_loadu_si256((const __m256i*)w);
  __m256i lo = _mm256_and_si256(v, m);
  __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
  __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xq));
  __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xq + 32)));
  return _mm256_add_epi16(p0, p1);
}

static inline __m256i widen(__m256i v16) { return _mm256_madd_epi16(v16, _mm256_set1_epi16(1)); }

#if defined(__FMA__)
#define EDGE0_AVX2_8BIT 1
// 8-bit weights on AVX2 (routers): float activations, as u8 x s8 pairs overflow vpmaddubsw; 16 weights per
// step into two 8-lane FMA sums, scaled per group in the lanes, one horizontal sum per output.
template <typename S>
static float dot_avx2_8(const uint8_t* w, const S* s, const S* b, const float* x, const float* xsum, int64_t D,
                        int gs) {
  const int64_t G = D / gs;
  __m256 acc = _mm256_setzero_ps();
  float bias = 0.f;
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* wg = w + g * gs;
    const float* xg = x + g * gs;
    for (int j = 0; j < gs; j += 64) _mm_prefetch((const char*)(wg + j + PREFETCH_BYTES), _MM_HINT_T0);
    __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps();
    for (int j = 0; j < gs; j += 16) {
      const __m128i w16 = _mm_loadu_si128((const __m128i*)(wg + j));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(w16));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(w16, 8)));
      t0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg + j), t0);
      t1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + j + 8), t1);
    }
    acc = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), _mm256_set1_ps(wval(s, g)), acc);
    bias += wval(b, g) * xsum[g];
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h) + bias;
}
#endif

// Per 128-bit lane: [sum4(a0), sum4(a1), sum4(a2), sum4(a3)] of that lane's 4 int32s.
static inline __m256i tree4(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
}

// isum[g] = sum over group g of q * xq, for all G groups (isum has room for G rounded up to 8).
template <int GS>
static void group_sums(const uint8_t* w, const int8_t* xq, int64_t D, int32_t* isum) {
  const int64_t G = D / GS;
  if constexpr (GS == 32) {
    const int64_t C = D / 64;  // a chunk is two groups, one per 128-bit lane
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t c0 = 0; c0 < C; c0 += 4) {  // 128 bytes of weights
      _mm_prefetch((const char*)(w + c0 * 32 + PREFETCH_BYTES), _MM_HINT_T0);
      _mm_prefetch((const char*)(w + c0 * 32 + 64 + PREFETCH_BYTES), _MM_HINT_T0);
      __m256i a[4];
      for (int i = 0; i < 4; i++)
        a[i] = c0 + i < C ? widen(chunk16(w + (c0 + i) * 32, xq + (c0 + i) * 64)) : _mm256_setzero_si256();
      __m256i t = _mm256_permutevar8x32_epi32(tree4(a[0], a[1], a[2], a[3]), perm);
      _mm256_storeu_si256((__m256i*)(isum + 2 * c0), t);
    }
  } else {
    constexpr int CPG = GS / 64;  // chunks per group
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
      __m256i a[8];
      for (int i = 0; i < 8; i++) {
        int64_t g = g0 + i;
        if (g >= G) {
          a[i] = _mm256_setzero_si256();
          continue;
        }
        if (CPG == 2 || (g & 1) == 0) _mm_prefetch((const char*)(w + g * GS / 2 + PREFETCH_BYTES), _MM_HINT_T0);
        __m256i v = chunk16(w + g * GS / 2, xq + g * GS);
        if constexpr (CPG == 2) v = _mm256_add_epi16(v, chunk16(w + g * GS / 2 + 32, xq + g * GS + 64));
        a[i] = widen(v);
      }
      __m256i t = tree4(a[0], a[1], a[2], a[3]), u = tree4(a[4], a[5], a[6], a[7]);
      __m256i r = _mm256_add_epi32(_mm256_permute2x128_si256(t, u, 0x20), _mm256_permute2x128_si256(t, u, 0x31));
      _mm256_storeu_si256((__m256i*)(isum + g0), r);
    }
  }
}

// sum_g s[g] * xs[g] * isum[g] + b[g] * xsum[g]
template <typename S>
static inline float combine(const S* s, const S* b, const float* xs, const float* xsum, const int32_t* isum,
                            int64_t G) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) {
    __m256 d = _mm256_mul_ps(load8(s + g), _mm256_loadu_ps(xs + g));
    acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(isum + g))), acc);
    acc = _mm256_fmadd_ps(load8(b + g), _mm256_loadu_ps(xsum + g), acc);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float r = _mm_cvtss_f32(h);
  for (; g < G; g++) r += wval(s, g) * xs[g] * (float)isum[g] + wval(b, g) * xsum[g];
  return r;
}

// Group sums of one weight row against up to TILE_ROWS activation rows at once (group size 64): each 64-weight
// chunk is loaded and split into nibbles once for all the rows, then reduced 4 groups at a time. Integer sums are
// exact in any order, so isum[r] holds the very values group_sums<64> gives for row r alone.
constexpr int TILE_ROWS = 4;

static void group_sums_rows64(const uint8_t* w, const int8_t* const* xq, int rows, int64_t D, int32_t* const* isum) {
  const int64_t G = D / 64;
  const __m256i m = _mm256_set1_epi8(0x0F);
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    __m256i lo[4], hi[4];
    for (int i = 0; i < 4; i++) {
      if (g0 + i < G) {
        _mm_prefetch((const char*)(w + (g0 + i) * 32 + PREFETCH_BYTES), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + (g0 + i) * 32));
        lo[i] = _mm256_and_si256(v, m);
        hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
      } else {
        lo[i] = hi[i] = _mm256_setzero_si256();
      }
    }
    for (int r = 0; r < rows; r++) {
      __m256i a[4];
      for (int i = 0; i < 4; i++) {
        const int8_t* x = xq[r] + std::min(g0 + i, G - 1) * 64;  // past G: zero weights, any activations
        a[i] = widen(_mm256_add_epi16(_mm256_maddubs_epi16(lo[i], _mm256_loadu_si256((const __m256i*)x)),
                                      _mm256_maddubs_epi16(hi[i], _mm256_loadu_si256((const __m256i*)(x + 32)))));
      }
      const __m256i t = tree4(a[0], a[1], a[2], a[3]);
      const __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      _mm_storeu_si128((__m128i*)(isum[r] + g0), sum);
    }
  }
}

template <typename S>
static float dot_avx2(const uint8_t* w, const S* s, const S* b, const int8_t* xq, const float* xs,
                      const float* xsum, int64_t D, int gs) {
  alignas(32) int32_t isum[MAX_GROUPS + 8];
  switch (gs) {
    case 32: group_sums<32>(w, xq, D, isum); break;
    case 64: group_sums<64>(w, xq, D, isum); break;
    default: group_sums<128>(w, xq, D, isum); break;
  }
  return combine(s, b, xs, xsum, isum, D / gs);
}
#endif

#if defined(EDGE0_VNNI)
// Scales and biases as float32 or as bfloat16 bits (widened in the register: the high half of the word).
static inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
static inline __m512 load16(const uint16_t* p, __mmask16 k) {
  return widen16(_mm256_maskz_loadu_epi16(k, p));
}

// The lane sums of four vectors at once: lane 4k of the result is a_k's sum, summed in _mm512_reduce_add_ps's order
// (lane i + lane i+8, then i + i+4, then 0 + 2 and 1 + 3, then 0 + 1; a float sum's two terms commute), so each has
// the bits its own reduction gives it, in 12 instructions instead of 4 x 8 with their latency chains.
static inline __m512 sums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
  return _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
}

// NW weight rows (w + j * row_bytes; their scales and biases G apart) against R activation rows at once; out[r * NW
// + j]. 128 weights (64 bytes) per step: vpdpbusd sums 4 nibble x int8 products per int32 lane, lane l covering
// elements 8l..8l+7 of the step, so a lane lies in one group: GS/8 lanes per group. The lane sums are scaled in
// float by their group's s * xs and accumulated; no horizontal sums until the end. Each 64-byte weight load and
// its nibble split serve every activation row, each activation chunk every weight row, and each pair's float
// arithmetic is the same whatever R and NW: every output gets the bits it gets alone. Several activation rows
// share an expert in a prompt chunk (the row tile); several weight rows interleave a decode token's short rows,
// whose one dependent chain and reductions left the core idle.
template <int GS, int R, int NW, typename S>
static void dot_vnni_tile(const uint8_t* w, int64_t row_bytes, const S* s, const S* b, const int8_t* const* xq,
                          const float* const* xs, const float* const* xsum, int64_t D, float* out) {
  const int64_t G = D / GS, steps = D / 128;
  constexpr int STEP_GROUPS = 128 / GS;  // groups per step: 4, 2, 1
  const __m512i first = GS == 32   ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                        : GS == 64 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                   : _mm512_setzero_si512();
  const __m512i advance = _mm512_set1_epi32(STEP_GROUPS);
  const __m512i m = _mm512_set1_epi8(0x0F);
  // a row asks for its bytes the block's span ahead at least: PREFETCH_BYTES alone would land in the block's own
  // later rows, already being read
  const int64_t ahead = NW == 1 ? PREFETCH_BYTES : std::max<int64_t>(PREFETCH_BYTES, NW * row_bytes);
  // The groups' factors s * xs stay in a register per pair, 16 groups at a time, and reach the lanes by a
  // permute: no store and reload per step.
  __m512 f0[R][NW], f1[R][NW], bias[R][NW], d[R][NW];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < NW; j++) f0[r][j] = f1[r][j] = bias[r][j] = _mm512_setzero_ps();
  int64_t i = 0;
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const __mmask16 k = G - g0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g0)) - 1);
    for (int j = 0; j < NW; j++) {
      const __m512 sv = load16(s + j * G + g0, k), bv = load16(b + j * G + g0, k);
      for (int r = 0; r < R; r++) {
        d[r][j] = _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(k, xs[r] + g0));
        bias[r][j] = _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(k, xsum[r] + g0), bias[r][j]);
      }
    }
    __m512i lane_group = first;
    for (const int64_t end = std::min(steps, (g0 + 16) / STEP_GROUPS); i < end; i++) {
      __m512i x0[R], x1[R];
      for (int r = 0; r < R; r++) {
        x0[r] = _mm512_loadu_si512((const void*)(xq[r] + i * 128));
        x1[r] = _mm512_loadu_si512((const void*)(xq[r] + i * 128 + 64));
      }
      for (int j = 0; j < NW; j++) {
        const uint8_t* wj = w + j * row_bytes + i * 64;
        _mm_prefetch((const char*)(wj + ahead), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512((const void*)wj);
        const __m512i lo = _mm512_and_si512(v, m), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
        for (int r = 0; r < R; r++) {
          __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x0[r]);
          acc = _mm512_dpbusd_epi32(acc, hi, x1[r]);
          const __m512 dl = _mm512_permutexvar_ps(lane_group, d[r][j]);
          if (i & 1)
            f1[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), dl, f1[r][j]);
          else
            f0[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), dl, f0[r][j]);
        }
      }
      lane_group = _mm512_add_epi32(lane_group, advance);
    }
  }
  // Four pairs: their sums in one pass (sums4), each with the bits of its own _mm512_reduce_add_ps.
  alignas(64) float sum4[16];
  if constexpr (R * NW == 4) {
    __m512 f[4], c[4];
    for (int r = 0; r < R; r++)
      for (int j = 0; j < NW; j++) {
        f[r * NW + j] = _mm512_add_ps(f0[r][j], f1[r][j]);
        c[r * NW + j] = bias[r][j];
      }
    _mm512_store_ps(sum4, _mm512_add_ps(sums4(f[0], f[1], f[2], f[3]), sums4(c[0], c[1], c[2], c[3])));
  }
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < NW; j++) {
      float t;
      if constexpr (R * NW == 4)
        t = sum4[4 * (r * NW + j)];
      else
        t = _mm512_reduce_add_ps(_mm512_add_ps(f0[r][j], f1[r][j])) + _mm512_reduce_add_ps(bias[r][j]);
      if (D % 128) {  // the last 64 elements (GS 32 or 64): 8 lanes of 8 elements
        const int64_t c = steps * 128, g = c / GS;
        const __m256i m8 = _mm256_set1_epi8(0x0F);
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + j * row_bytes + c / 2));
        const __m256i lo = _mm256_and_si256(v, m8), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m8);
        __m256i acc =
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i*)(xq[r] + c)));
        acc = _mm256_dpbusd_epi32(acc, hi, _mm256_loadu_si256((const __m256i*)(xq[r] + c + 32)));
        const float d0 = wval(s + j * G, g) * xs[r][g], d1 = GS == 32 ? wval(s + j * G, g + 1) * xs[r][g + 1] : d0;
        const __m256 dl = _mm256_setr_m128(_mm_set1_ps(d0), _mm_set1_ps(d1));
        alignas(32) float t8[8];
        _mm256_store_ps(t8, _mm256_mul_ps(_mm256_cvtepi32_ps(acc), dl));
        for (float v8 : t8) t += v8;
      }
      out[r * NW + j] = t;
    }
  }
}

// W's row w against R activation rows at once (R = 1: one dot product).
template <int GS, int R, typename S>
static void dot_vnni_rows(const uint8_t* w, const S* s, const S* b, const int8_t* const* xq, const float* const* xs,
                          const float* const* xsum, int64_t D, float* out) {
  dot_vnni_tile<GS, R, 1>(w, 0, s, b, xq, xs, xsum, D, out);
}

template <int GS, typename S>
static float dot_vnni(const uint8_t* w, const S* s, const S* b, const int8_t* xq, const float* xs,
                      const float* xsum, int64_t D) {
  float out;
  dot_vnni_rows<GS, 1>(w, s, b, &xq, &xs, &xsum, D, &out);
  return out;
}

// Four consecutive 4-bit weight rows against one activation row on the VNNI path (dot_vnni_tile).
template <typename S>
static void vnni_rows4(int gs, const uint8_t* w, int64_t row_bytes, const S* s, const S* b, const int8_t* xq,
                       const float* xs, const float* xsum, int64_t D, float* out) {
  if (gs == 32)
    dot_vnni_tile<32, 1, 4>(w, row_bytes, s, b, &xq, &xs, &xsum, D, out);
  else if (gs == 64)
    dot_vnni_tile<64, 1, 4>(w, row_bytes, s, b, &xq, &xs, &xsum, D, out);
  else
    dot_vnni_tile<128, 1, 4>(w, row_bytes, s, b, &xq, &xs, &xsum, D, out);
}

// 8-bit: 64 weights (64 bytes) per step, lane l covering elements 4l..4l+3 (GS/4 lanes per group).
template <int GS, typename S>
static float dot_vnni8(const uint8_t* w, const S* s, const S* b, const int8_t* xq, const float* xs,
                       const float* xsum, int64_t D) {
  const int64_t G = D / GS;
  alignas(64) float d[MAX_GROUPS + 16];
  __m512 bias = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 k = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
    _mm512_store_ps(d + g, _mm512_mul_ps(load16(s + g, k), _mm512_maskz_loadu_ps(k, xs + g)));
    bias = _mm512_fmadd_ps(load16(b + g, k), _mm512_maskz_loadu_ps(k, xsum + g), bias);
  }
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 f0 = _mm512_setzero_ps(), f1 = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 64; i++) {
    _mm_prefetch((const char*)(w + i * 64 + PREFETCH_BYTES), _MM_HINT_T0);
    const __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512((const void*)(w + i * 64)),
                                            _mm512_loadu_si512((const void*)(xq + i * 64)));
    __m512 dl;
    if constexpr (GS == 32)
      dl = _mm512_permutexvar_ps(halves, _mm512_loadu_ps(d + 2 * i));
    else
      dl = _mm512_set1_ps(d[i * 64 / GS]);
    if (i & 1)
      f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), dl, f1);
    else
      f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), dl, f0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(f0, f1)) + _mm512_reduce_add_ps(bias);
}

template <typename S>
static float vnni(int bits, int gs, const uint8_t* w, const S* s, const S* b, const int8_t* xq, const float* xs,
                  const float* xsum, int64_t D) {
  if (bits == 8)
    return gs == 32   ? dot_vnni8<32>(w, s, b, xq, xs, xsum, D)
           : gs == 64 ? dot_vnni8<64>(w, s, b, xq, xs, xsum, D)
                      : dot_vnni8<128>(w, s, b, xq, xs, xsum, D);
  return gs == 32   ? dot_vnni<32>(w, s, b, xq, xs, xsum, D)
         : gs == 64 ? dot_vnni<64>(w, s, b, xq, xs, xsum, D)
                    : dot_vnni<128>(w, s, b, xq, xs, xsum, D);
}
#endif

// One output: W's row w against an activation row, on the code path `impl` (xq, xs: its int8 form; xr: its
// floats; xsum: its group sums).
template <typename S>
static float row_dot(int impl, bool avx2_8bit, int bits, int gs, const uint8_t* w, const S* s, const S* b,
                     const int8_t* xq, const float* xs, const float* xsum, const float* xr, int64_t D) {
#if defined(EDGE0_VNNI)
  if (impl == VNNI) return vnni(bits, gs, w, s, b, xq, xs, xsum, D);
#endif
#if defined(EDGE0_AVX2)
  if (impl == AVX2) return dot_avx2(w, s, b, xq, xs, xsum, D, gs);
#endif
#if defined(EDGE0_AVX2_8BIT)
  if (avx2_8bit) return dot_avx2_8(w, s, b, xr, xsum, D, gs);
#endif
  return bits == 8 ? dot_portable8(w, s, b, xr, xsum, D, gs) : dot_portable(w, s, b, xr, xsum, D, gs);
}

// ---------------------------------------------------------------------------------------------

#if defined(EDGE0_AVX2)
// Outputs n0..n1 of expert e for `count` pairs that share it (4-bit, group size 64, AVX2): per weight row, the
// group sums of TILE_ROWS activation rows at a time (group_sums_rows64), then each output as dot_avx2 combines
// it, so every output has the bits row_dot gives it alone.
template <typename S>
static void rows_avx2_s(const QWeights& q, const S* scales, const S* biases, int64_t e, int64_t n0, int64_t n1,
                        const Pair* pairs, int64_t count, const Acts& acts, float* out) {
  const int64_t N = q.N, D = q.D, G = D / 64, row_bytes = D / 2;
  alignas(32) int32_t isum[TILE_ROWS][MAX_GROUPS + 8];
  for (int64_t n = n0; n < n1; n++) {
    const int64_t row = e * N + n;
    for (int64_t r0 = 0; r0 < count; r0 += TILE_ROWS) {
      const int rows = (int)std::min<int64_t>(TILE_ROWS, count - r0);
      const int8_t* xq[TILE_ROWS];
      int32_t* sums[TILE_ROWS];
      for (int r = 0; r < rows; r++) {
        xq[r] = acts.q.data() + pairs[r0 + r].xrow * D;
        sums[r] = isum[r];
      }
      group_sums_rows64(q.w + row * row_bytes, xq, rows, D, sums);
      for (int r = 0; r < rows; r++) {
        const Pair& pr = pairs[r0 + r];
        out[pr.out * N + n] = combine(scales + row * G, biases + row * G, acts.scale.data() + pr.xrow * G,
                                      acts.sums.data() + pr.xrow * G, isum[r], G);
      }
    }
  }
}
#endif

#if defined(EDGE0_VNNI)
// The same on the VNNI path (4-bit, any group size): dot_vnni_rows over TILE_ROWS rows at a time; count is a
// multiple of TILE_ROWS (qmv gives the rows left over the four-row product).
template <int GS, typename S>
static void rows_vnni_s(const QWeights& q, const S* scales, const S* biases, int64_t e, int64_t n0, int64_t n1,
                        const Pair* pairs, int64_t count, const Acts& acts, float* out) {
  const int64_t N = q.N, D = q.D, G = D / GS, row_bytes = D / 2;
  for (int64_t n = n0; n < n1; n++) {
    const int64_t row = e * N + n;
    const uint8_t* w = q.w + row * row_bytes;
    const S *s = scales + row * G, *b = biases + row * G;
    for (int64_t r0 = 0; r0 + TILE_ROWS <= count; r0 += TILE_ROWS) {
      const int8_t* xq[TILE_ROWS];
      const float *xs[TILE_ROWS], *xsum[TILE_ROWS];
      float v[TILE_ROWS];
      for (int r = 0; r < TILE_ROWS; r++) {
        const int64_t xr = pairs[r0 + r].xrow;
        xq[r] = acts.q.data() + xr * D;
        xs[r] = acts.scale.data() + xr * G;
        xsum[r] = acts.sums.data() + xr * G;
      }
      dot_vnni_rows<GS, TILE_ROWS>(w, s, b, xq, xs, xsum, D, v);
      for (int r = 0; r < TILE_ROWS; r++) out[pairs[r0 + r].out * N + n] = v[r];
    }
  }
}

// A reduction of 16 vectors lane by lane, in _mm512_reduce_add_ps's order (lane i + lane i+8, then i + i+4, then
// 0 + 2 and 1 + 3, then 0 + 1): lane j of the result is what that reduction gives the vector of v[0..15]'s lanes j.
static inline __m512 reduce16(const float (*v)[16]) {
  __m512 w[8];
  for (int i = 0; i < 8; i++) w[i] = _mm512_add_ps(_mm512_load_ps(v[i]), _mm512_load_ps(v[i + 8]));
  for (int i = 0; i < 4; i++) w[i] = _mm512_add_ps(w[i], w[i + 4]);
  return _mm512_add_ps(_mm512_add_ps(w[0], w[2]), _mm512_add_ps(w[1], w[3]));
}

// 16 output rows of a packed block (Packed) against R activation rows; out[r] receives 16 floats. dot_vnni_tile's
// arithmetic turned on its side: where it keeps one output's 16 lanes l (word l of each 128-element step i) in a
// vector, this keeps lane l of 16 outputs in one, so step i's int8 word of x is a broadcast and its weight word a
// 64-byte load. Each output's float operations are the same in the same order (a lane's products of step i into
// f0 or f1 by i's parity, f0 + f1, the lanes' sum in reduce_add_ps's order; the biases' lanes likewise), so it has
// the bits it gets in the row layout.
template <int GS, int R, typename S>
static void dot_vnni_packed(const uint32_t* pw, const S* ps, const S* pb, const int8_t* const* xq,
                            const float* const* xs, const float* const* xsum, int64_t D, float* const* out) {
  const int64_t G = D / GS, steps = D / 128;
  thread_local std::vector<float> dbuf;
  if ((int64_t)dbuf.size() < R * G * 16) dbuf.resize(R * G * 16);
  float* dv = dbuf.data();  // (R, G, 16): s * xs, each group's factor for the 16 outputs
  for (int r = 0; r < R; r++)
    for (int64_t g = 0; g < G; g++)
      _mm512_storeu_ps(dv + (r * G + g) * 16, _mm512_mul_ps(wide16(ps + g * 16), _mm512_set1_ps(xs[r][g])));
  alignas(64) float lanes[R][16][16];
  const __m512i m = _mm512_set1_epi8(0x0F);
  for (int l = 0; l < 16; l++) {
    __m512 f0[R], f1[R];
    for (int r = 0; r < R; r++) f0[r] = f1[r] = _mm512_setzero_ps();
    const uint32_t* p = pw + (int64_t)l * steps * 16;
    for (int64_t i = 0; i < steps; i++) {
      const __m512i v = _mm512_loadu_si512((const void*)(p + i * 16));
      const __m512i lo = _mm512_and_si512(v, m), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
      const int64_t g = (128 * i + 8 * l) / GS;
      for (int r = 0; r < R; r++) {
        int32_t x0, x1;
        std::memcpy(&x0, xq[r] + i * 128 + 4 * l, 4);
        std::memcpy(&x1, xq[r] + i * 128 + 64 + 4 * l, 4);
        __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_set1_epi32(x0));
        acc = _mm512_dpbusd_epi32(acc, hi, _mm512_set1_epi32(x1));
        const __m512 d = _mm512_loadu_ps(dv + (r * G + g) * 16);
        if (i & 1)
          f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), d, f1[r]);
        else
          f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), d, f0[r]);
      }
    }
    for (int r = 0; r < R; r++) _mm512_store_ps(lanes[r][l], _mm512_add_ps(f0[r], f1[r]));
  }
  alignas(64) float bias[16][16];
  for (int r = 0; r < R; r++) {
    // bias lane k: groups k, k + 16, ... (fmadd; a lane past the last group adds the masked load's 0 * 0)
    for (int k = 0; k < 16; k++) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t g = k; g - k < G; g += 16)
        a = g < G ? _mm512_fmadd_ps(wide16(pb + g * 16), _mm512_set1_ps(xsum[r][g]), a)
                  : _mm512_add_ps(a, _mm512_setzero_ps());
      _mm512_store_ps(bias[k], a);
    }
    _mm512_storeu_ps(out[r], _mm512_add_ps(reduce16(lanes[r]), reduce16(bias)));
  }
}

// Outputs n0..n1 (multiples of 16) of expert e for `count` pairs sharing it, on the packed copy: each block of 16
// outputs against 8, 4, 2 or 1 rows at a time.
template <int GS, typename S>
static void rows_packed(const QWeights& q, const S* scales, const S* biases, int64_t e, int64_t n0, int64_t n1,
                        const Pair* pairs, int64_t count, const Acts& acts, float* out) {
  const Packed& p = *q.packed;
  const int64_t N = q.N, D = q.D, G = D / GS, NB = N / 16, steps = D / 128;
  for (int64_t n = n0; n < n1; n += 16) {
    const int64_t blk = e * NB + n / 16;
    const uint32_t* pw = p.w.data() + blk * 16 * steps * 16;
    const S *ps = scales + blk * G * 16, *pb = biases + blk * G * 16;
    for (int64_t r0 = 0; r0 < count;) {
      const int64_t left = count - r0;
      const int R = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      const int8_t* xq[8];
      const float *xs[8], *xsum[8];
      float* o[8];
      for (int r = 0; r < R; r++) {
        const Pair& pr = pairs[r0 + r];
        xq[r] = acts.q.data() + pr.xrow * D;
        xs[r] = acts.scale.data() + pr.xrow * G;
        xsum[r] = acts.sums.data() + pr.xrow * G;
        o[r] = out + pr.out * N + n;
      }
      if (R == 8)
        dot_vnni_packed<GS, 8, S>(pw, ps, pb, xq, xs, xsum, D, o);
      else if (R == 4)
        dot_vnni_packed<GS, 4, S>(pw, ps, pb, xq, xs, xsum, D, o);
      else if (R == 2)
        dot_vnni_packed<GS, 2, S>(pw, ps, pb, xq, xs, xsum, D, o);
      else
        dot_vnni_packed<GS, 1, S>(pw, ps, pb, xq, xs, xsum, D, o);
      r0 += R;
    }
  }
}

static void run_packed(const QWeights& q, int64_t e, int64_t n0, int64_t n1, const Pair* pairs, int64_t count,
                       const Acts& acts, float* out) {
  const Packed& p = *q.packed;
  auto run = [&](auto GS) {
    constexpr int gs = decltype(GS)::value;
    if (!p.s16.empty())
      rows_packed<gs>(q, p.s16.data(), p.b16.data(), e, n0, n1, pairs, count, acts, out);
    else
      rows_packed<gs>(q, p.s.data(), p.b.data(), e, n0, n1, pairs, count, acts, out);
  };
  if (q.group_size == 32)
    run(std::integral_constant<int, 32>{});
  else if (q.group_size == 64)
    run(std::integral_constant<int, 64>{});
  else
    run(std::integral_constant<int, 128>{});
}
#endif

#if defined(EDGE0_VNNI)
static bool packable(const QWeights& q) { return packable(q.N, q.D, q.group_size, q.bits); }

// A copy's vectors sized, zero (LineAligned: a large one not yet mapped in).
static std::shared_ptr<Packed> new_packed(int64_t E, int64_t N, int64_t D, int group_size, bool bf16) {
  const int64_t G = D / group_size;
  auto p = std::make_shared<Packed>();
  p->E = E, p->N = N, p->D = D, p->group_size = group_size;
  p->w.resize(E * N * (D / 8));
  if (bf16) {  // one pair of scales and biases: as stored (bfloat16), or float32
    p->s16.resize(E * N * G);
    p->b16.resize(E * N * G);
  } else {
    p->s.resize(E * N * G);
    p->b.resize(E * N * G);
  }
  return p;
}

// A large vector's pages mapped in now (zero), rather than at the first write of each: a page first touched inside a
// fill makes that fill wait for it. One write a page (a 2 MiB one where advised) faults it in; MADV_POPULATE_WRITE
// would hold the process's mmap lock throughout, so that the prompt's allocations meanwhile wait for it.
template <class T>
static void populate(LineVector<T>& v) {
#ifdef MADV_HUGEPAGE
  const size_t bytes = v.size() * sizeof(T), page = (size_t)sysconf(_SC_PAGESIZE);
  if (bytes < LineAligned<T>::HUGE_BYTES) return;  // written at allocation
  volatile char* at = reinterpret_cast<volatile char*>(v.data());
  for (size_t b = 0; b < bytes; b += page) at[b] = 0;
#else
  (void)v;
#endif
}
#endif

void pack_experts(const QWeights& q, int64_t e0, int64_t e1, Packed& p, bool every_core) {
#if defined(EDGE0_VNNI)
  const int64_t G = q.D / q.group_size, NB = q.N / 16, steps = q.D / 128, row_bytes = q.D / 2;
  const bool bf16 = q.scales16 != nullptr;  // kept as stored: half the bytes a product reads for them
  // blocks of 16 rows, each writing its own part of the copy; on every core where asked (a whole copy, made at load)
  const int64_t first = e0 * NB, BB = 64, words = row_bytes / 4;  // blocks a task; words a row
  const auto blocks = [&](int64_t task) {
    for (int64_t blk = first + task * BB; blk < std::min(e1 * NB, first + (task + 1) * BB); blk++) {
      // rows of all experts in order: expert e's block b is blk e * NB + b; each written word of the block's copy
      // in turn (the 16 rows' word 16 i + l side by side), as the copy is laid out: the block's writes are one run
      uint32_t* dst = p.w.data() + blk * 16 * steps * 16;
      const uint32_t* src = reinterpret_cast<const uint32_t*>(q.w) + blk * 16 * words;
      for (int l = 0; l < 16; l++)
        for (int64_t i = 0; i < steps; i++) {
          uint32_t* out = dst + (l * steps + i) * 16;
          const uint32_t* in = src + i * 16 + l;
          for (int j = 0; j < 16; j++) out[j] = in[j * words];
        }
      for (int j = 0; j < 16; j++) {
        const int64_t row = blk * 16 + j;
        for (int64_t g = 0; g < G; g++) {
          const int64_t at_ = (blk * G + g) * 16 + j;
          if (bf16) {
            p.s16[at_] = q.scales16[row * G + g];
            p.b16[at_] = q.biases16[row * G + g];
          } else {
            p.s[at_] = q.scales[row * G + g];
            p.b[at_] = q.biases[row * G + g];
          }
        }
      }
    }
  };
  const int64_t tasks = ((e1 - e0) * NB + BB - 1) / BB;
  if (every_core)
    parallel_for(tasks, blocks, true);
  else
    for (int64_t t = 0; t < tasks; t++) blocks(t);
#else
  (void)q, (void)e0, (void)e1, (void)p, (void)every_core;
#endif
}

bool packable(int64_t N, int64_t D, int group_size, int bits) {
#if defined(EDGE0_VNNI)
  return bits == 4 && group_size > 0 && N % 16 == 0 && D % 128 == 0 && D <= PACK_MAX_D &&
         D / group_size <= PACK_MAX_GROUPS && (group_size == 32 || group_size == 64 || group_size == 128);
#else
  (void)N, (void)D, (void)group_size, (void)bits;
  return false;
#endif
}

std::shared_ptr<Packed> zero_packed(int64_t E, int64_t N, int64_t D, int group_size, bool bf16) {
#if defined(EDGE0_VNNI)
  if (!packable(N, D, group_size, 4)) return nullptr;
  auto p = new_packed(E, N, D, group_size, bf16);
  populate(p->w), populate(p->s), populate(p->b), populate(p->s16), populate(p->b16);
  return p;
#else
  (void)E, (void)N, (void)D, (void)group_size, (void)bf16;
  return nullptr;
#endif
}

std::shared_ptr<const Packed> pack(const QWeights& q, bool fill) {
#if defined(EDGE0_VNNI)
  if (!packable(q)) return nullptr;
  if (!fill) return zero_packed(q.E, q.N, q.D, q.group_size, q.scales16 != nullptr);  // as zero weights pack
  auto p = new_packed(q.E, q.N, q.D, q.group_size, q.scales16 != nullptr);
  pack_experts(q, 0, q.E, *p, true);
  return p;
#else
  (void)q, (void)fill;
  return nullptr;
#endif
}

// Outputs n0..n1 of expert e for `count` pairs sharing it, on a path that loads each weight row once for several
// activation rows; false where there is none for this path and format (the caller then runs row_dot per row).
static bool rows_tile(int impl, const QWeights& q, int64_t e, int64_t n0, int64_t n1, const Pair* pairs,
                      int64_t count, const Acts& acts, float* out) {
  if (q.bits != 4) return false;
  const bool bf16 = q.scales16 != nullptr;
#if defined(EDGE0_VNNI)
  if (impl == VNNI) {
    auto run = [&](auto GS) {
      constexpr int gs = decltype(GS)::value;
      if (bf16)
        rows_vnni_s<gs>(q, q.scales16, q.biases16, e, n0, n1, pairs, count, acts, out);
      else
        rows_vnni_s<gs>(q, q.scales, q.biases, e, n0, n1, pairs, count, acts, out);
      return true;
    };
    if (q.group_size == 32) return run(std::integral_constant<int, 32>{});
    if (q.group_size == 64) return run(std::integral_constant<int, 64>{});
    return run(std::integral_constant<int, 128>{});
  }
#endif
#if defined(EDGE0_AVX2)
  if (impl == AVX2 && q.group_size == 64) {
    if (bf16)
      rows_avx2_s(q, q.scales16, q.biases16, e, n0, n1, pairs, count, acts, out);
    else
      rows_avx2_s(q, q.scales, q.biases, e, n0, n1, pairs, count, acts, out);
    return true;
  }
#endif
  return false;
}

void qmv(const QWeights& q, const float* x, int64_t x_rows, const std::vector<Pair>& pairs, float* out, bool prompt) {
  const int64_t N = q.N, D = q.D, G = D / q.group_size;
  const int gs = q.group_size;
  // 8-bit weights: the VNNI path, else the plain one (int8 x uint8 pairs overflow vpmaddubsw)
  const int impl = q.bits == 8 && use_impl.load() != VNNI ? PORTABLE : use_impl.load();
  const bool quant = impl != PORTABLE;
  const bool avx2_8bit = q.bits == 8 && use_impl.load() == AVX2;  // float activations (dot_avx2_8)
  Pool& p = pool();
  const int threads = prompt ? prompt_threads_.load() : decode_threads.load();

  // activations: one task per block of rows
  thread_local Acts tl_acts;
  Acts& acts = tl_acts;  // a reference: the lambdas below run on other threads
  acts.sums.resize(x_rows * G);
  acts.scale.resize(x_rows * G);
  acts.q.resize(quant ? x_rows * D : 0);
  const int64_t RB = 64;
  p.run((x_rows + RB - 1) / RB, [&](int64_t t) {
    for (int64_t r = t * RB; r < std::min(x_rows, (t + 1) * RB); r++)
      prepare_row(x + r * D, D, gs, impl, q.bits, acts.sums.data() + r * G, acts.scale.data() + r * G,
                  quant ? acts.q.data() + r * D : nullptr);
  }, threads);

  // pairs grouped by expert, so that rows sharing an expert read its weights once (prefill)
  std::vector<Pair> sorted(pairs);
  std::stable_sort(sorted.begin(), sorted.end(), [](const Pair& a, const Pair& b) { return a.expert < b.expert; });
  struct Run {
    int64_t begin, end;
  };
  std::vector<Run> runs;
  for (int64_t i = 0; i < (int64_t)sorted.size();) {
    int64_t j = i;
    while (j < (int64_t)sorted.size() && sorted[j].expert == sorted[i].expert) j++;
    runs.push_back({i, j});
    i = j;
  }

  // tasks: (run, block of output features); enough of them to keep every thread busy
  // the packed layout: impl VNNI and 4-bit (pack made it), blocks of 16 outputs
  const bool packed = q.packed != nullptr && impl == VNNI && use_packed.load(std::memory_order_relaxed);
  int64_t nb = 64;
  while (nb > (packed ? 16 : 8) && (int64_t)runs.size() * ((N + nb - 1) / nb) < 8 * threads) nb /= 2;
  const int64_t blocks = (N + nb - 1) / nb;
  const int64_t ntask = (int64_t)runs.size() * blocks;
  const int64_t row_bytes = D * q.bits / 8;

  p.run(ntask, [&](int64_t t) {
    const Run& run = runs[t / blocks];
    const int64_t n0 = (t % blocks) * nb, n1 = std::min(N, n0 + nb);
    const int64_t e = sorted[run.begin].expert;
    if (e < 0 || e >= q.E) {  // out-of-range index: zeros rather than a wild read
      for (int64_t i = run.begin; i < run.end; i++) std::fill(out + sorted[i].out * N + n0, out + sorted[i].out * N + n1, 0.f);
      return;
    }
#if defined(EDGE0_VNNI)
    if (packed && (D <= PACK_ONE_ROW_D || run.end - run.begin >= TILE_ROWS)) {
      run_packed(q, e, n0, n1, sorted.data() + run.begin, run.end - run.begin, acts, out);
      return;
    }
#endif
    const int64_t PB = 16, NS = 4;  // rows x features per tile: the tile's weights stay in L1
    for (int64_t i0 = run.begin; i0 < run.end; i0 += PB) {
      const int64_t i1 = std::min(run.end, i0 + PB);
      // several rows of one expert: each weight row loaded once for them all. On the VNNI path whole tiles only:
      // a row left over takes four weight rows at once below (independent chains), not one alone.
      int64_t first = i0;
#if defined(EDGE0_VNNI)
      const int64_t tiled = impl == VNNI ? (i1 - i0) / TILE_ROWS * TILE_ROWS : i1 - i0;
#else
      const int64_t tiled = i1 - i0;
#endif
      if (tiled > 1 && rows_tile(impl, q, e, n0, n1, sorted.data() + i0, tiled, acts, out)) first = i0 + tiled;
      for (int64_t m0 = n0; m0 < n1 && first < i1; m0 += NS) {
        const int64_t m1 = std::min(n1, m0 + NS);
        for (int64_t i = first; i < i1; i++) {
          const Pair& pr = sorted[i];
#if defined(EDGE0_VNNI)
          if (impl == VNNI && q.bits == 4 && m1 - m0 == 4) {  // four outputs at once, each with its own bits
            const int64_t row = e * N + m0, G0 = pr.xrow * G;
            const int8_t* xq = acts.q.data() + pr.xrow * D;
            if (q.scales16 != nullptr)
              vnni_rows4(gs, q.w + row * row_bytes, row_bytes, q.scales16 + row * G, q.biases16 + row * G, xq,
                         acts.scale.data() + G0, acts.sums.data() + G0, D, out + pr.out * N + m0);
            else
              vnni_rows4(gs, q.w + row * row_bytes, row_bytes, q.scales + row * G, q.biases + row * G, xq,
                         acts.scale.data() + G0, acts.sums.data() + G0, D, out + pr.out * N + m0);
            continue;
          }
#endif
          const float* xsum = acts.sums.data() + pr.xrow * G;
          for (int64_t n = m0; n < m1; n++) {
            const int64_t row = e * N + n;
            const uint8_t* w = q.w + row * row_bytes;
            const int8_t* xq = quant ? acts.q.data() + pr.xrow * D : nullptr;
            const float* xs = acts.scale.data() + pr.xrow * G;
            const float* xr = x + pr.xrow * D;
            const float v = q.scales16 != nullptr
                                ? row_dot(impl, avx2_8bit, q.bits, gs, w, q.scales16 + row * G, q.biases16 + row * G,
                                          xq, xs, xsum, xr, D)
                                : row_dot(impl, avx2_8bit, q.bits, gs, w, q.scales + row * G, q.biases + row * G, xq,
                                          xs, xsum, xr, D);
            out[pr.out * N + n] = v;
          }
        }
      }
    }
  }, threads);
}

}  // namespace edge0
