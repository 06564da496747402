// 4-bit affine quantized matrix-vector products over MLX's packed layout, no MLX types here.
//
// Layout (as MLX stores it, no repacking): W (E, N, D*bits/32) uint32; 4-bit: 8 nibbles per word,
// element j of a word in bits 4j..4j+3; 8-bit: a byte per element. Scales and biases (E, N, D/gs)
// float32, or bfloat16 as stored (widened where each group is used, exactly); w = s * q + b per group.
// So per group: sum_i x_i w_i = s * sum_i x_i q_i + b * sum_i x_i.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <new>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>
#include <vector>

namespace edge0 {

constexpr int MAX_GROUPS = 4096;  // D / group_size at most (per-row scratch on the stack)

// One output row o: its x row and its expert (the weight matrix it multiplies).
struct Pair {
  int64_t expert;
  int64_t xrow;
  int64_t out;
};

struct Packed;

struct QWeights {
  const uint8_t* w;  // (E, N, D/2) bytes
  const float* scales;  // (E, N, D/gs) float32, or null with scales16
  const float* biases;  // (E, N, D/gs) float32, or null with biases16
  int64_t E, N, D;
  int group_size;
  int bits;  // 4 or 8
  const uint16_t* scales16 = nullptr;  // (E, N, D/gs) bfloat16 bits: 2 bytes a group instead of 4 to stream
  const uint16_t* biases16 = nullptr;
  const Packed* packed = nullptr;  // the same weights in the packed layout (pack), or null
};

// The packed copies' storage: on 64-byte lines (a packed word of 16 rows is one 64-byte load, and one line where the
// copy starts on one; malloc's large blocks start 16 bytes past a page, so every load touched two lines), and from
// 2 MiB up (Linux) a fresh mapping of its own on 2 MiB pages, advised onto transparent huge pages before its first
// touch where the system allows them: a product streams an expert's rows (1.6 MiB of the workload's gate) through one
// TLB entry a 2 MiB page instead of 512 (malloc's blocks may reuse memory already touched on 4 KiB pages).
// Its memory comes zeroed (a fresh mapping is; a smaller block is cleared) and a vector's resize writes nothing more
// (Packed resizes each vector once, from empty): a copy is written once, by pack_experts, or mapped in by
// zero_packed.
template <class T>
struct LineAligned {
  using value_type = T;
  static constexpr std::align_val_t align{64};
  static constexpr size_t HUGE_BYTES = size_t(2) << 20;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  static size_t mapped(size_t bytes) {  // whole pages
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + page - 1) / page * page;
  }
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
#ifdef MADV_HUGEPAGE
    if (bytes >= HUGE_BYTES) {
      const size_t len = mapped(bytes), span = len + HUGE_BYTES;
      void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (raw == MAP_FAILED) throw std::bad_alloc();
      char *lo = static_cast<char*>(raw), *at = lo + (HUGE_BYTES - (uintptr_t)lo % HUGE_BYTES) % HUGE_BYTES;
      if (at > lo) munmap(lo, at - lo);  // the slack around the 2 MiB-aligned range goes back
      if (lo + span > at + len) munmap(at + len, lo + span - (at + len));
      madvise(at, len, MADV_HUGEPAGE);  // refused (no THP): 4 KiB pages, the same bytes
      return reinterpret_cast<T*>(at);
    }
#endif
    T* p = static_cast<T*>(::operator new(bytes, align));
    std::memset(p, 0, bytes);
    return p;
  }
  template <class U>
  void construct(U* p) {  // zero already: the allocation is
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  void deallocate(T* p, size_t n) {
#ifdef MADV_HUGEPAGE
    if (n * sizeof(T) >= HUGE_BYTES) {
      munmap(p, mapped(n * sizeof(T)));
      return;
    }
#endif
    ::operator delete(p, align);
  }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <class T>
using LineVector = std::vector<T, LineAligned<T>>;

// A 4-bit weight's copy for the VNNI path with 16 output rows interleaved by 4-byte word: one 64-byte load holds
// one word of 16 rows, so vpdpbusd leaves 16 outputs' partial sums in its lanes and no output needs horizontal
// sums of its own. The arithmetic is the row layout's, in the same order: every output gets the same bits from
// either layout, whatever the rows or threads. Made once for weights that never change (a model's dense
// linears); a product whose QWeights carry it runs on it.
struct Packed {
  LineVector<uint32_t> w;  // (E, N/16, 16 l, D/128 i, 16 rows): word 16 i + l of each of the block's rows
  LineVector<float> s, b;  // (E, N/16, G, 16): scales and biases, float32 ...
  LineVector<uint16_t> s16, b16;  // ... or bfloat16 as stored (widened exactly where used); one pair is empty
  int64_t E = 0, N = 0, D = 0;
  int group_size = 0;
};

// Groups a packed row may have at most (per-call scratch of R x G x 16 floats).
constexpr int64_t PACK_MAX_GROUPS = 512;
// Rows (inputs D) the packed layout pays for, by measurement: up to 512 for one activation row, up to 1024 for
// TILE_ROWS or more sharing the weight; longer rows already spend little per output on its lane sums, so they are
// not packed.
constexpr int64_t PACK_ONE_ROW_D = 512, PACK_MAX_D = 1024;

// Whether N x D weights of these bits and group size have a packed layout (false where no VNNI path is built).
bool packable(int64_t N, int64_t D, int group_size, int bits);

// A zero packed copy of E experts of N x D 4-bit weights (a new slot bank's), its pages mapped in: made ahead of the
// bank's first use (reserve_pack, on a thread of its own while the prompt computes) and taken by pack; null where
// the layout does not apply.
std::shared_ptr<Packed> zero_packed(int64_t E, int64_t N, int64_t D, int group_size, bool bf16);

// q's packed copy; null where the layout does not apply (not 4-bit, N % 16, D % 128, D > PACK_MAX_D, more than
// PACK_MAX_GROUPS groups, or no VNNI path built).
// fill false: q is all zeros (a new slot bank), so is its copy, made without reading q.
std::shared_ptr<const Packed> pack(const QWeights& q, bool fill = true);

// Experts e0..e1-1 of q written again into p, q's packed copy: for weights that change only expert by expert, while
// no product reads those experts (a slot bank's fills, compute/banks.py: on the calling thread, an I/O thread beside
// the stream's products); every_core: on the prompt threads (a whole copy, pack).
void pack_experts(const QWeights& q, int64_t e0, int64_t e1, Packed& p, bool every_core = false);

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
// set_impl names another one built here (tests, benchmarks), false when it is not; impls: those built, narrowest first.
const char* impl();
bool set_impl(const char* name);
std::vector<std::string> impls();

// Whether products run on packed copies where weights have one (default true); off, every product takes the row
// layout (the same bits): tests compare the two on the same weights.
void set_packed(bool on);
bool packed_on();

// Compute threads, the caller included (one persistent pool of max(n, prompt) - 1 workers): n for a
// decode step's products, prompt (n when 0) for prompt chunks'.
void set_num_threads(int n, int prompt = 0);
int num_threads();
int prompt_threads();

// The cores the pool's workers may run on (empty: any; Linux only, elsewhere nothing), and those of the first worker.
void place_workers(const std::vector<int>& cpus);
std::vector<int> worker_cpus();
// The same for the calling thread.
void set_this_thread_cpus(const std::vector<int>& cpus);
std::vector<int> this_thread_cpus();

// fn(i) for every i in [0, n) on the pool's prompt threads (prompt) or decode threads, the caller included.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn, bool prompt);

}  // namespace edge0
