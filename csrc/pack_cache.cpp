// Packed copies of 4-bit weights (qmv.h's Packed), kept for the weights they were made from (pack_cache.h).
#include "pack_cache.h"

#include <nanobind/nanobind.h>  // the GIL is let go while a copy is made or awaited

#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>

#include "mlx/transforms.h"

namespace nb = nanobind;

namespace edge0 {

// The packed width tells the bits: D/8 words at 4 bits, D/4 at 8.
static int bits_of(const mx::array& w, int64_t D) { return w.shape(-1) * 8 == D ? 4 : 8; }

// Packed copies of weights that never change (pack_weights), found by the weight's data: an entry matches only
// while the very buffers it was made from (weight, scales, biases) are alive, held by reference counts the entry
// does not take part in, so a freed weight's address passed to a new array never finds the old copy.
using DataRef = std::weak_ptr<mx::array::Data>;
struct PackEntry {
  DataRef w, s, b;
  const void *s_ptr, *b_ptr;
  std::shared_ptr<const Packed> packed;
};
static std::mutex packs_mu;
static std::map<const void*, PackEntry> packs_;
static std::atomic<size_t> packs_held{0};  // packs_.size(), read without the lock

static bool same(const DataRef& ref, const mx::array& a) {
  const auto live = ref.lock();
  return live != nullptr && live == a.data_shared_ptr();
}

static std::shared_ptr<const Packed> find_packed(const mx::array& w, const mx::array& s, const mx::array& b,
                                                 const QWeights& q, bool any = false) {
  // every product asks: those that cannot have a copy leave before the lock (any: whether products use it or not)
  if (q.bits != 4 || packs_held.load(std::memory_order_relaxed) == 0 || (!any && !packed_on()) ||
      !w.flags().row_contiguous ||
      !s.flags().row_contiguous || !b.flags().row_contiguous)
    return nullptr;
  std::lock_guard<std::mutex> lk(packs_mu);
  const auto it = packs_.find(w.data<void>());
  if (it == packs_.end()) return nullptr;
  const PackEntry& e = it->second;
  const Packed& p = *e.packed;
  if (!same(e.w, w) || !same(e.s, s) || !same(e.b, b) || e.s_ptr != s.data<void>() || e.b_ptr != b.data<void>() ||
      p.E != q.E || p.N != q.N || p.D != q.D || p.group_size != q.group_size)
    return nullptr;
  return e.packed;
}

QWeights qweights(const mx::array& w, const mx::array& s, const mx::array& b, int64_t D, int gs, QTemps& t) {
  QWeights q{(const uint8_t*)dense_data<uint32_t>(w, t.w), nullptr, nullptr, w.ndim() == 3 ? w.shape(0) : 1,
             w.shape(-2), D, gs, bits_of(w, D)};
  if (s.dtype() == mx::bfloat16) {
    q.scales16 = dense_data<uint16_t>(s, t.s16);
    q.biases16 = dense_data<uint16_t>(b, t.b16);
  } else {
    q.scales = dense_data<float>(s, t.s);
    q.biases = dense_data<float>(b, t.b);
  }
  t.packed = find_packed(w, s, b, q);
  q.packed = t.packed.get();
  return q;
}

// Whether (w, scales, biases) are 4-bit weights as a product takes them, (E,) N x D/8 words with D/gs scales and
// biases a row, every array row-contiguous: those pack and packed may look at (anything else: no copy, false).
static bool four_bit(const mx::array& w, const mx::array& s, const mx::array& b, int gs) {
  if (w.dtype() != mx::uint32 || (s.dtype() != mx::float32 && s.dtype() != mx::bfloat16) || b.dtype() != s.dtype() ||
      w.ndim() < 2 || w.ndim() > 3 || s.ndim() != w.ndim() || b.shape() != s.shape() || gs <= 0 ||
      !w.flags().row_contiguous || !s.flags().row_contiguous || !b.flags().row_contiguous)
    return false;
  for (int d = 0; d + 1 < w.ndim(); d++)
    if (s.shape(d) != w.shape(d)) return false;
  return (int64_t)s.shape(-1) * gs == (int64_t)w.shape(-1) * 8;  // 4-bit: 8 a word
}

// Where the packed copy's words lie (0: no copy): the memory a product streams, for checking its pages.
uintptr_t packed_address(mx::array w, mx::array s, mx::array b, int gs) {
  mx::eval({w, s, b});
  QTemps t;
  if (!four_bit(w, s, b, gs)) return 0;
  const Packed* p = qweights(w, s, b, (int64_t)w.shape(-1) * 8, gs, t).packed;
  return p == nullptr ? 0 : (uintptr_t)p->w.data();
}

bool is_packed(mx::array w, mx::array s, mx::array b, int gs) { return packed_address(w, s, b, gs) != 0; }

uintptr_t PackReservation::address() {
  nb::gil_scoped_release nogil;
  return copy.valid() ? (uintptr_t)copy.get()->w.data() : 0;
}

  std::shared_ptr<Packed> PackReservation::take() {
    if (!copy.valid()) return nullptr;
#ifdef SCHED_IDLE
    if (copy.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
      maker->wanted.store(true);  // on a busy machine an idle thread may wait long: normal priority again
      const pthread_t t = maker->thread.load();  // 0: it has not run yet, and will see `wanted`
      sched_param none{};
      if (t) pthread_setschedparam(t, SCHED_OTHER, &none);  // not joined before get(): its id is still its own
    }
#endif
    auto p = copy.get();
    copy = {};
    return p;
  }

std::optional<PackReservation> reserve_pack(int64_t E, int64_t N, int64_t D, int gs, bool bf16) {
  if (!packable(N, D, gs, 4)) return std::nullopt;
  auto maker = std::make_shared<PackReservation::Maker>();
  const auto made = [=] {
#ifdef SCHED_IDLE
    // on a core the prompt leaves idle (its reads, its syncs): its compute goes first; a bank's first use that finds
    // the copy unmade puts this thread back at normal priority and waits (take)
    maker->thread.store(pthread_self());
    sched_param none{};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
    if (maker->wanted.load()) pthread_setschedparam(pthread_self(), SCHED_OTHER, &none);
#endif
    return zero_packed(E, N, D, gs, bf16);
  };
  return PackReservation{std::async(std::launch::async, made).share(), maker, E, N, D, gs, bf16};
}

// Make and keep the packed copy of (w, scales, biases) for the products that read these arrays from now on; false
// where the layout does not apply (its products keep the row layout, with the same bits). Entries of freed
// weights are dropped here.
bool pack_weights(mx::array w, mx::array s, mx::array b, int gs, bool zeros, PackReservation* reserved) {
  mx::eval({w, s, b});
  if (!four_bit(w, s, b, gs)) return false;
  QTemps t;
  QWeights q = qweights(w, s, b, (int64_t)w.shape(-1) * 8, gs, t);
  if (q.packed != nullptr) return true;  // already
  std::shared_ptr<const Packed> p;
  {
    nb::gil_scoped_release nogil;  // a large copy takes a while: reads on the I/O threads go on meanwhile
    const auto r = zeros && reserved != nullptr && reserved->fits(q) ? reserved->take() : nullptr;
    p = r ? r : pack(q, !zeros);
  }
  if (p == nullptr) return false;
  std::lock_guard<std::mutex> lk(packs_mu);
  for (auto it = packs_.begin(); it != packs_.end();)
    it = it->second.w.expired() || it->second.s.expired() || it->second.b.expired() ? packs_.erase(it) : std::next(it);
  packs_[w.data<void>()] = PackEntry{w.data_shared_ptr(), s.data_shared_ptr(), b.data_shared_ptr(), s.data<void>(),
                                     b.data<void>(), std::move(p)};
  packs_held.store(packs_.size(), std::memory_order_relaxed);
  return true;
}

// A slot bank's fills: the experts `slots` of (w, scales, biases), packed by pack_weights, were written again; their
// packed copy follows. Only while no product reads those experts (the bank's rule for its slots); products of other
// experts may run meanwhile (they read other rows of the copy). False where the arrays have no packed copy.
bool repack_weights(mx::array w, mx::array s, mx::array b, int gs, const std::vector<int64_t>& slots) {
  nb::gil_scoped_release nogil;  // on an I/O thread: the graph-building thread goes on meanwhile
  QTemps t;
  QWeights q = qweights(w, s, b, (int64_t)w.shape(-1) * 8, gs, t);
  const auto packed = find_packed(w, s, b, q, true);  // kept up to date while products do not use it too
  if (packed == nullptr) return false;
  Packed& p = const_cast<Packed&>(*packed);  // made by pack_weights, never shared as const data elsewhere
  for (const int64_t e : slots) {
    if (e < 0 || e >= q.E) throw std::invalid_argument("edge0 repack: slot " + std::to_string(e) + " out of range");
    pack_experts(q, e, e + 1, p);
  }
  return true;
}

}  // namespace edge0
