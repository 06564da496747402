// The packed copies of 4-bit weights that never change (a model's dense linears, resident experts, slot banks): made
// by pack_weights, followed by repack_weights, found by a product's qweights from the very arrays they were made from.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <vector>

#include "nodes.h"
#include "qmv.h"

namespace edge0 {

// Scales and biases float32, or bfloat16 as stored (the kernel widens them where it uses them).
struct QTemps {
  std::vector<uint32_t> w;
  std::vector<float> s, b;
  std::vector<uint16_t> s16, b16;
  std::shared_ptr<const Packed> packed;  // kept alive while the product runs
};

// A new slot bank's zero packed copy, made on a thread of its own from reserve_pack (while the prompt computes) and
// taken by the bank's pack(zeros=True): faulting in its pages is then not paid by its first use (the prompt's last
// token). Freed with the object where never taken.
struct PackReservation {
  std::shared_future<std::shared_ptr<Packed>> copy;
  struct Maker {
    std::atomic<pthread_t> thread{};  // the thread making the copy (0 until it runs)
    std::atomic<bool> wanted{false};  // a bank waits for the copy: made at normal priority from now on
  };
  std::shared_ptr<Maker> maker;
  int64_t E, N, D;
  int group_size;
  bool bf16;
  bool fits(const QWeights& q) const {  // a copy of q's shape
    return copy.valid() && E == q.E && N == q.N && D == q.D && group_size == q.group_size &&
           bf16 == (q.scales16 != nullptr);
  }
  uintptr_t address();  // waits for the copy
  std::shared_ptr<Packed> take();  // once: waits for the copy
};

// The arrays' weights as a product reads them (x widths D, group size gs), with their packed copy where they have one;
// t holds the copies of strided arrays, and the packed copy alive, while the product runs.
QWeights qweights(const mx::array& w, const mx::array& s, const mx::array& b, int64_t D, int gs, QTemps& t);

// Where the packed copy's words lie (0: no copy): the memory a product streams, for checking its pages.
uintptr_t packed_address(mx::array w, mx::array s, mx::array b, int gs);
bool is_packed(mx::array w, mx::array s, mx::array b, int gs);

std::optional<PackReservation> reserve_pack(int64_t E, int64_t N, int64_t D, int gs, bool bf16);

// Make and keep the packed copy of (w, scales, biases) for the products that read these arrays from now on; false
// where the layout does not apply (its products keep the row layout, with the same bits).
bool pack_weights(mx::array w, mx::array s, mx::array b, int gs, bool zeros, PackReservation* reserved);

// The experts `slots` of packed weights were written again (a slot bank's fills): their packed copy follows.
bool repack_weights(mx::array w, mx::array s, mx::array b, int gs, const std::vector<int64_t>& slots);

}  // namespace edge0
