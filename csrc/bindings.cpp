// MLX primitives over the kernels of qmv.cpp, and their Python bindings (nanobind, MLX's domain so
// that functions take mx.array directly). The functions here only build graph nodes; eval_cpu runs
// the kernel on MLX's CPU stream thread.

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <future>
#include <optional>
#include <pthread.h>
#include <sched.h>
#include <sstream>
#include <thread>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "mlx/version.h"
#include "dense.h"
#include "qmv.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

#define EDGE0_STR2(x) #x
#define EDGE0_STR(x) EDGE0_STR2(x)

namespace edge0 {

// Inputs are taken as MLX hands them to eval_cpu, views included: no Contiguous node is added to the
// graph (a node costs microseconds of dispatch, more than these copies); a strided input is copied here.
// The copy goes by runs: the trailing axes that are contiguous in the view (a KV cache trimmed at its front, a
// batch's rows taken) are one memcpy each, the outer axes an odometer; a view with no contiguous axis (a
// transpose, a broadcast) copies element by element. A served batch copies its KV caches when sequences join or
// leave: element by element that was 16% of the server's CPU under load (perf on `edge0 serve --max-batch 8`).
template <typename T>
static const T* dense_data(const mx::array& a, std::vector<T>& tmp) {
  if (a.flags().row_contiguous) return a.data<T>();
  tmp.resize(a.size());
  if (a.size() == 0) return tmp.data();
  const T* src = a.data<T>();
  const int nd = a.ndim();
  int inner = nd;  // axes [inner, nd) are contiguous: one run of `run` elements
  int64_t run = 1;
  while (inner > 0 && (a.strides()[inner - 1] == run || a.shape(inner - 1) == 1)) run *= a.shape(--inner);
  std::vector<int64_t> idx(inner, 0);
  T* dst = tmp.data();
  for (size_t done = 0; done < a.size(); done += run, dst += run) {
    int64_t off = 0;
    for (int d = 0; d < inner; d++) off += idx[d] * a.strides()[d];
    if (run == 1) *dst = src[off];
    else std::memcpy(dst, src + off, run * sizeof(T));
    for (int d = inner - 1; d >= 0 && ++idx[d] == a.shape(d); d--) idx[d] = 0;
  }
  return tmp.data();
}

static View4 view4(const mx::array& a) {
  View4 v{a.data<float>(), {}, {}};
  for (int d = 0; d < 4; d++) {
    v.shape[d] = a.shape(d);
    v.strides[d] = a.strides()[d];
  }
  return v;
}

// Time inside each kind of edge0 node: off unless set_profile(true); a node's
// key is its name, and for products its output and input widths.
static std::atomic<bool> profiling{false};
static std::mutex profile_mu;
static std::map<std::string, std::pair<int64_t, double>> profile_;  // key -> (nodes, seconds)

class ProfileScope {
 public:
  template <typename K>
  explicit ProfileScope(K&& key) {
    if (profiling.load(std::memory_order_relaxed)) {
      key_ = key();
      t0_ = std::chrono::steady_clock::now();
      on_ = true;
    }
  }
  ~ProfileScope() {
    if (!on_) return;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    std::lock_guard<std::mutex> lk(profile_mu);
    auto& e = profile_[key_];
    e.first += 1;
    e.second += s;
  }

 private:
  std::string key_;
  std::chrono::steady_clock::time_point t0_;
  bool on_ = false;
};

// The packed width tells the bits: D/8 words at 4 bits, D/4 at 8.
static int bits_of(const mx::array& w, int64_t D) { return w.shape(-1) * 8 == D ? 4 : 8; }

// Scales and biases float32, or bfloat16 as stored (the kernel widens them where it uses them).
struct QTemps {
  std::vector<uint32_t> w;
  std::vector<float> s, b;
  std::vector<uint16_t> s16, b16;
  std::shared_ptr<const Packed> packed;  // kept alive while the product runs
};

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

static QWeights qweights(const mx::array& w, const mx::array& s, const mx::array& b, int64_t D, int gs, QTemps& t) {
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
static uintptr_t packed_address(mx::array w, mx::array s, mx::array b, int gs) {
  mx::eval({w, s, b});
  QTemps t;
  if (!four_bit(w, s, b, gs)) return 0;
  const Packed* p = qweights(w, s, b, (int64_t)w.shape(-1) * 8, gs, t).packed;
  return p == nullptr ? 0 : (uintptr_t)p->w.data();
}

static bool is_packed(mx::array w, mx::array s, mx::array b, int gs) { return packed_address(w, s, b, gs) != 0; }

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
  uintptr_t address() {  // waits for the copy
    nb::gil_scoped_release nogil;
    return copy.valid() ? (uintptr_t)copy.get()->w.data() : 0;
  }
  std::shared_ptr<Packed> take() {  // once: waits for the copy
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
};

static std::optional<PackReservation> reserve_pack(int64_t E, int64_t N, int64_t D, int gs, bool bf16) {
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
static bool pack_weights(mx::array w, mx::array s, mx::array b, int gs, bool zeros, PackReservation* reserved) {
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
static bool repack_weights(mx::array w, mx::array s, mx::array b, int gs, const std::vector<int64_t>& slots) {
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

// A dense quantized projection, y = W x (+ scale * (x A) B with an adapter), for inputs x (R rows of D), w, scales,
// biases[, lora_a (D, r), lora_b (r, N)]: what an Edge0QMV node without indices or an Edge0QMVLoRA node computes.
// A node that takes such a node's output while it is not yet evaluated can run it itself (absorbed), its inputs
// leading the node's own: one node fewer, the same function, the same bits.
struct Projection {
  int inputs = 0;  // 0: none absorbed; 4: x, w, scales, biases; 6: with lora_a, lora_b
  int group_size = 0;
  float scale = 0.f;  // the adapter's
  bool operator==(const Projection& o) const {
    return inputs == o.inputs && group_size == o.group_size && scale == o.scale;
  }
};

// A node whose output a later node can compute in its place (Absorbed: an add-norm its residual, a top-k or a head
// its router's product, a top-k its head): the node's function of its inputs, into a float32 buffer of the output's
// size. The same code as the node's own evaluation, so the same bits.
struct Computes {
  virtual ~Computes() = default;
  virtual void compute(const std::vector<mx::array>& in, float* out, int64_t size) const = 0;
};

// Output row o reads x row o / ratio (ratio = rows per x row) and expert idx[o] (or 0 without idx).
// Inputs: x (..., D), w, scales, biases[, idx (any shape, R entries)]; output R x N, in any shape.
// With glu, the weights are those of gate, up and down (9 arrays) and row o is
// down[idx[o]] @ (silu(gate[idx[o]] @ x) * (up[idx[o]] @ x)): a routed expert's whole product. With combine (a glu
// with idx), one more input, scores (T, K): the output is (T, N), each token's K rows weighed and summed as
// Edge0Combine sums them (combine_op builds it from a GLU node and its scores).
class QMV : public mx::UnaryPrimitive, public Computes {
 public:
  QMV(mx::Stream stream, int group_size, int64_t ratio, bool has_idx, bool glu, bool combine = false)
      : mx::UnaryPrimitive(stream), group_size_(group_size), ratio_(ratio), has_idx_(has_idx), glu_(glu),
        combine_(combine) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, gs = group_size_, ratio = ratio_, has_idx = has_idx_, glu = glu_,
                  combine = combine_]() mutable {
      const int64_t D = inputs[0].shape(-1), Rx = inputs[0].size() / D;
      ProfileScope scope([&] {
        return std::string(glu ? (combine ? "Edge0GLU+Combine " : "Edge0GLU ") : "Edge0QMV ") +
               std::to_string(inputs[1].shape(-2)) + "x" + std::to_string(D) + (Rx >= PROMPT_ROWS ? " prompt" : "");
      });
      run(inputs, out.data<float>(), out.size(), gs, ratio, has_idx, glu, combine);
    });
  }

  void compute(const std::vector<mx::array>& in, float* out, int64_t size) const override {
    run(in, out, size, group_size_, ratio_, has_idx_, glu_, combine_);
  }

  // remap (optional): each index's position in the weights (a slot bank's table of expert id -> slot)
  static void run(const std::vector<mx::array>& inputs, float* out, int64_t size, int gs, int64_t ratio, bool has_idx,
                  bool glu, bool combine, const uint32_t* remap = nullptr) {
    const auto& x = inputs[0];
    const int64_t D = x.shape(-1), Rx = x.size() / D;
    const size_t nw = glu ? 9 : 3;
    std::vector<float> xt;
    std::vector<uint32_t> it;
    std::vector<QTemps> temps(3);
    std::vector<QWeights> q;
    for (size_t j = 0; j < nw; j += 3) {
      const int64_t Dj = j < 6 ? D : inputs[1].shape(-2);  // down reads the gate/up width
      q.push_back(qweights(inputs[1 + j], inputs[2 + j], inputs[3 + j], Dj, gs, temps[j / 3]));
    }
    const int64_t N = q.back().N, R = has_idx ? inputs[1 + nw].size() : size / N;
    const uint32_t* idx = has_idx ? dense_data<uint32_t>(inputs[1 + nw], it) : nullptr;
    std::vector<Pair> pairs(R);
    for (int64_t o = 0; o < R; o++) pairs[o] = {idx ? (int64_t)(remap ? remap[idx[o]] : idx[o]) : 0, o / ratio, o};
    const float* xd = dense_data<float>(x, xt);
    const bool prompt = spread(Rx);  // token rows: a prompt chunk or a batch's step
    if (!glu) {
      qmv(q[0], xd, Rx, pairs, out, prompt);
      return;
    }
    const int64_t H = q[0].N;
    std::unique_ptr<float[]> gp(new float[R * H]), up(new float[R * H]);  // every value written by qmv: not zeroed
    float *g = gp.get(), *u = up.get();
    qmv(q[0], xd, Rx, pairs, g, prompt);
    qmv(q[1], xd, Rx, pairs, u, prompt);
    swiglu(g, u, R * H);
    for (int64_t o = 0; o < R; o++) pairs[o].xrow = o;
    if (!combine) {
      qmv(q[2], g, R, pairs, out, prompt);
      return;
    }
    std::unique_ptr<float[]> y(new float[R * N]);
    std::vector<float> st;
    qmv(q[2], g, R, pairs, y.get(), prompt);
    const auto& scores = inputs.back();
    const int k = scores.shape(-1);
    edge0::combine(y.get(), dense_data<float>(scores, st), R / k, k, N, out);
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }

  const char* name() const override { return glu_ ? "Edge0GLU" : "Edge0QMV"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMV&>(other);
    return group_size_ == o.group_size_ && ratio_ == o.ratio_ && has_idx_ == o.has_idx_ && glu_ == o.glu_ &&
           combine_ == o.combine_;
  }
  // a GLU node (not a combined one) with indices: combine_op can take its place
  bool combinable() const { return glu_ && has_idx_ && !combine_; }
  // a plain product (no indices): another node can run it; none (inputs 0) otherwise
  Projection projection() const { return glu_ || has_idx_ ? Projection{} : Projection{4, group_size_, 0.f}; }
  std::shared_ptr<QMV> combined() {
    return std::make_shared<QMV>(stream(), group_size_, ratio_, has_idx_, glu_, true);
  }

 private:
  int group_size_;
  int64_t ratio_;
  bool has_idx_, glu_, combine_;
};

static void adapt_arrays(const float* xd, int64_t R, int64_t D, const mx::array& a, const mx::array& b, float scale,
                         float* y);

// The projection of R rows xd of D values; its weights in[w], in[w + 1], in[w + 2][, adapter in[w + 3], in[w + 4]].
static void project_rows(const float* xd, int64_t R, int64_t D, const std::vector<mx::array>& in, size_t w,
                         const Projection& p, float* y) {
  QTemps temps;
  const QWeights q = qweights(in[w], in[w + 1], in[w + 2], D, p.group_size, temps);
  std::vector<Pair> pairs(R);
  for (int64_t o = 0; o < R; o++) pairs[o] = {0, o, o};
  qmv(q, xd, R, pairs, y, spread(R));
  if (p.inputs < 6) return;
  adapt_arrays(xd, R, D, in[w + 3], in[w + 4], p.scale, y);
}

// y (R, N) += scale * (xd A) B, A and B arrays (D, r) and (r, N) of float32 or bfloat16: a branch beside a block
static void adapt_arrays(const float* xd, int64_t R, int64_t D, const mx::array& a, const mx::array& b, float scale,
                         float* y) {
  const int64_t N = b.shape(-1), r = a.shape(-1);
  if (a.dtype() == mx::bfloat16) {
    std::vector<uint16_t> at, bt;
    adapt(xd, R, D, dense_data<uint16_t>(a, at), dense_data<uint16_t>(b, bt), N, r, scale, y);
  } else {
    std::vector<float> at, bt;
    adapt(xd, R, D, dense_data<float>(a, at), dense_data<float>(b, bt), N, r, scale, y);
  }
}

// in[0] (x) and the weights after it
static void project(const std::vector<mx::array>& in, const Projection& p, float* y) {
  std::vector<float> xt;
  const int64_t D = in[0].shape(-1);
  project_rows(dense_data<float>(in[0], xt), in[0].size() / D, D, in, 1, p, y);
}

// x's attention node (Edge0DecodeAttention, not yet evaluated) running the projection (weights: w, scales, biases[,
// lora_a, lora_b]) of its output itself, as one node of that shape; nothing where x is no such node.
static std::optional<mx::array> attention_then(const mx::array& x, const std::vector<mx::array>& weights,
                                               const Projection& p, const mx::Shape& shape);

// A dense quantized linear with an unmerged low-rank adapter, one node: out = W x + scale * (x A) B, for
// x (..., D), W (N, D*bits/32), A (D, r), B (r, N) float32 (the recovery adapter of model/lora.py).
class QMVLoRA : public mx::UnaryPrimitive, public Computes {
 public:
  QMVLoRA(mx::Stream stream, int group_size, float scale)
      : mx::UnaryPrimitive(stream), group_size_(group_size), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, gs = group_size_, scale = scale_]() mutable {
      const int64_t D = inputs[0].shape(-1), R = inputs[0].size() / D;
      ProfileScope scope([&] {
        return "Edge0QMV+LoRA " + std::to_string(inputs[1].shape(-2)) + "x" + std::to_string(D) +
               (R >= PROMPT_ROWS ? " prompt" : "");
      });
      project(inputs, Projection{6, gs, scale}, out.data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }
  const char* name() const override { return "Edge0QMVLoRA"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMVLoRA&>(other);
    return group_size_ == o.group_size_ && scale_ == o.scale_;
  }
  Projection projection() const { return {6, group_size_, scale_}; }
  void compute(const std::vector<mx::array>& in, float* out, int64_t) const override { project(in, projection(), out); }

 private:
  int group_size_;
  float scale_;
};

[[noreturn]] static void fail(const std::string& m) { throw std::invalid_argument("edge0 qmv/glu: " + m); }

// w (E, N, D*bits/32) or (N, D*bits/32) uint32 (4 or 8 bits), scales and biases (..., N, D/gs) float32 or
// both bfloat16 -> N
static int64_t check_weights(const mx::array& w, const mx::array& scales, const mx::array& biases, int64_t D,
                             int group_size) {
  if ((w.ndim() != 2 && w.ndim() != 3) || w.dtype() != mx::uint32) fail("w must be (E, N, D*bits/32) uint32");
  if (scales.dtype() != biases.dtype() || (scales.dtype() != mx::float32 && scales.dtype() != mx::bfloat16))
    fail("scales and biases must be both float32 or both bfloat16");
  const int64_t N = w.shape(-2), G = D / group_size;
  if (N < 1 || (w.ndim() == 3 && w.shape(0) < 1)) fail("w must hold at least one expert and one output row");
  if (D < 64 || D % 64 != 0 || D % group_size != 0 || (w.shape(-1) * 8 != D && w.shape(-1) * 4 != D))
    fail("D must be a positive multiple of 64 and of group_size, matching w (4 or 8 bits)");
  if (G > MAX_GROUPS) fail("too many groups");
  if (scales.shape() != biases.shape() || scales.shape(-1) != G || scales.shape(-2) != N ||
      scales.ndim() != w.ndim() || (w.ndim() == 3 && scales.shape(0) != w.shape(0)))
    fail("scales/biases shape does not match w");
  return N;
}

// The output shape: `shape` when given (its size must be R * N), else (R, N).
static mx::Shape out_shape(std::optional<std::vector<int>> shape, int64_t R, int64_t N) {
  if (!shape) return {(int)R, (int)N};
  int64_t n = 1;
  for (int d : *shape) {
    if (d < 0) fail("shape must not have negative dimensions");
    n *= d;
  }
  if (n != R * N || shape->empty() || shape->back() != N) fail("shape must hold R x N outputs, N last");
  return mx::Shape(shape->begin(), shape->end());
}

static std::vector<mx::array> with_idx(std::vector<mx::array> inputs, const std::optional<mx::array>& idx,
                                       mx::Stream s) {
  if (idx && !mx::issubdtype(idx->dtype(), mx::integer)) fail("expert indices must be integers");
  if (idx) inputs.push_back(idx->dtype() == mx::uint32 ? *idx : mx::astype(*idx, mx::uint32, s));
  return inputs;
}

// x (..., D) float32 with Rx rows; idx (R entries) expert per output row, or none (R = Rx, expert 0).
// x (..., D) float32 of at least one row, a supported group size; returns the rows of x.
static int64_t check_x(const mx::array& x, int group_size) {
  if (x.ndim() < 1 || x.dtype() != mx::float32) fail("x must be (..., D) float32");
  if (group_size != 32 && group_size != 64 && group_size != 128) fail("group_size must be 32, 64 or 128");
  const int64_t rx = x.shape(-1) ? x.size() / x.shape(-1) : 0;
  if (rx == 0) fail("x must have at least one row");
  return rx;
}

static mx::array qmv_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                        std::optional<mx::array> idx, int group_size, std::optional<std::vector<int>> shape) {
  const int64_t rx = check_x(x, group_size);
  const int64_t D = x.shape(-1), N = check_weights(w, scales, biases, D, group_size);
  const int64_t R = idx ? idx->size() : rx;
  if (R % rx != 0) fail("index rows must be a multiple of x rows");
  if (!idx)
    if (auto fused = attention_then(x, {w, scales, biases}, Projection{4, group_size, 0.f}, out_shape(shape, R, N)))
      return *fused;
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(out_shape(shape, R, N), mx::float32, std::make_shared<QMV>(s, group_size, R / rx, (bool)idx, false),
                   with_idx({x, w, scales, biases}, idx, s));
}

// Whether an adapter's lora_a and lora_b are (D, r) and (r, N), r >= 1, both float32 or both bfloat16 (as served:
// half the bytes, widened exactly): a projection from D to N.
static bool lora_fits(const mx::array& a, const mx::array& b, int64_t D, int64_t N) {
  return (a.dtype() == mx::float32 || a.dtype() == mx::bfloat16) && b.dtype() == a.dtype() && a.ndim() == 2 &&
         b.ndim() == 2 && a.shape(0) == D &&
         b.shape(1) == N && a.shape(1) == b.shape(0) && a.shape(1) >= 1;
}

static mx::array qmv_lora_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                             const mx::array& a, const mx::array& b, float scale, int group_size) {
  const int64_t rx = check_x(x, group_size);
  const int64_t D = x.shape(-1), N = check_weights(w, scales, biases, D, group_size);
  if (w.ndim() != 2) fail("qmv_lora: w must be (N, D*bits/32)");
  if (!lora_fits(a, b, D, N)) fail("qmv_lora: lora_a must be (D, r) and lora_b (r, N), both float32 or both bfloat16");
  auto s = mx::default_stream(mx::Device::cpu);
  mx::Shape shape(x.shape().begin(), x.shape().end());
  shape.back() = (int)N;
  (void)rx;
  if (auto fused = attention_then(x, {w, scales, biases, a, b}, Projection{6, group_size, scale}, shape)) return *fused;
  return mx::array(shape, mx::float32, std::make_shared<QMVLoRA>(s, group_size, scale), {x, w, scales, biases, a, b});
}

// Routed experts' whole products, one node: row o = down(swiglu(gate(x), up(x))) of expert idx[o].
// Routed experts' gate, up, down (w, scales, biases each) for inputs of width D, checked: the down projection's
// width N.
static int64_t check_glu(const std::vector<mx::array>& gate, const std::vector<mx::array>& up,
                         const std::vector<mx::array>& down, int64_t D, int group_size) {
  if (gate.size() != 3 || up.size() != 3 || down.size() != 3) fail("gate, up, down are (w, scales, biases)");
  const int64_t H = check_weights(gate[0], gate[1], gate[2], D, group_size);
  if (check_weights(up[0], up[1], up[2], D, group_size) != H) fail("gate and up differ in width");
  const int64_t N = check_weights(down[0], down[1], down[2], H, group_size);
  if (gate[0].ndim() != 3 || up[0].shape() != gate[0].shape() || down[0].shape(0) != gate[0].shape(0))
    fail("gate, up, down must hold the same experts (E, ., .)");
  return N;
}

static mx::array glu_op(const mx::array& x, const mx::array& idx, const std::vector<mx::array>& gate,
                        const std::vector<mx::array>& up, const std::vector<mx::array>& down, int group_size,
                        std::optional<std::vector<int>> shape) {
  const int64_t rx = check_x(x, group_size);
  const int64_t N = check_glu(gate, up, down, x.shape(-1), group_size);
  const int64_t R = idx.size();
  if (R % rx != 0) fail("index rows must be a multiple of x rows");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(out_shape(shape, R, N), mx::float32, std::make_shared<QMV>(s, group_size, R / rx, true, true),
                   with_idx({x, gate[0], gate[1], gate[2], up[0], up[1], up[2], down[0], down[1], down[2]}, idx, s));
}

// The inputs a node keeps itself rather than list for MLX: arrays already evaluated when the node is built (a layer's
// weights, above all). MLX needs a node's inputs to order its work; an evaluated array orders nothing, yet every eval
// walks it (a hash-map entry and a stack push on the graph-building thread, a buffer-set entry, a copy in the list of
// each of the node's outputs): on the built-in model about 250 of a decode step's 300 inputs. The node's function
// still sees its whole input list, in its order (all()).
std::atomic<bool> holding{true};  // set_holding: off, every input listed for MLX (for A/B measurement)

class Held {
 public:
  // Moves the evaluated arrays of `in` into this, but those at `shown` (buffers the node passes on, which MLX must
  // see to let it), leaving in `in` the arrays MLX sees, in their order.
  void take(std::vector<mx::array>& in, std::initializer_list<size_t> shown = {}) {
    if (!holding.load(std::memory_order_relaxed)) return;
    std::vector<mx::array> seen;
    seen.reserve(in.size());
    layout_.clear();
    layout_.reserve(in.size());
    for (size_t i = 0; i < in.size(); i++) {
      const bool show = std::find(shown.begin(), shown.end(), i) != shown.end();
      if (!show && in[i].is_available()) {
        layout_.push_back(-1 - (int32_t)arrays_.size());
        arrays_.push_back(std::move(in[i]));
      } else {
        layout_.push_back((int32_t)seen.size());
        seen.push_back(std::move(in[i]));
      }
    }
    in = std::move(seen);
  }
  // The node's whole input list from those MLX gave it.
  std::vector<mx::array> all(const std::vector<mx::array>& seen) const {
    if (arrays_.empty()) return seen;
    std::vector<mx::array> in;
    in.reserve(layout_.size());
    for (int32_t at : layout_) in.push_back(at >= 0 ? seen[at] : arrays_[-1 - at]);
    return in;
  }
  // Where input i of the whole list stands among those MLX gives the node (a shown input).
  size_t seen_at(size_t i) const { return layout_.empty() ? i : (size_t)layout_[i]; }
  // The same arrays held in the same places (a node's is_equivalent: two nodes that differ only in what they hold
  // are not the same node)
  bool operator==(const Held& o) const {
    if (layout_ != o.layout_ || arrays_.size() != o.arrays_.size()) return false;
    for (size_t i = 0; i < arrays_.size(); i++)
      if (arrays_[i].id() != o.arrays_[i].id()) return false;
    return true;
  }

 private:
  std::vector<mx::array> arrays_;
  std::vector<int32_t> layout_;  // each input of the whole list: >= 0 its place among those MLX sees, < 0 -1 - its
                                 // place in arrays_ (empty: nothing held)
};

// A node that may keep some of its inputs itself (Held): its own function and a node running it inside (Absorbed)
// see the whole list (whole_inputs).
class Holder {
 public:
  virtual ~Holder() = default;
  // Keeps the evaluated arrays of the node's input list `in` (see Held), leaving in `in` those MLX must see.
  void hold(std::vector<mx::array>& in, std::initializer_list<size_t> shown = {}) { held_.take(in, shown); }
  const Held& held() const { return held_; }

 protected:
  Held held_;
};

// a's node's whole input list: those MLX sees and those the node keeps itself
static std::vector<mx::array> whole_inputs(const mx::array& a) {
  auto* h = dynamic_cast<const Holder*>(&a.primitive());
  return h ? h->held().all(a.inputs()) : a.inputs();
}

// The dense per-token ops of dense.h as primitives, one graph node each (float32 on the CPU).
class DenseOp : public mx::UnaryPrimitive, public Holder {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }

 protected:
  template <typename F>
  void dispatch(const std::vector<mx::array>& inputs, mx::array& out, F&& fn) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    run(inputs, out, std::forward<F>(fn));
  }

  // dispatch, for an output whose storage eval_cpu has set itself (a buffer passed on from an input)
  template <typename F>
  void run(const std::vector<mx::array>& inputs, mx::array& out, F&& fn) {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs = held_.all(inputs), out, fn = std::forward<F>(fn), name = name()]() mutable {
      ProfileScope scope([&] { return std::string(name); });
      fn(inputs, out);
    });
  }
};

class RMSNormOp : public DenseOp {
 public:
  RMSNormOp(mx::Stream s, float eps) : DenseOp(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [eps = eps_](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<float> xt, wt;
      const int64_t D = in[0].shape(-1);
      rms_norm(dense_data<float>(in[0], xt), dense_data<float>(in[1], wt), eps, in[0].size() / D, D,
               o.data<float>());
    });
  }
  const char* name() const override { return "Edge0RMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RMSNormOp&>(other).eps_ && held_ == static_cast<const RMSNormOp&>(other).held_;
  }

 private:
  float eps_;
};

class LogSoftmaxOp : public DenseOp {
 public:
  using DenseOp::DenseOp;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<float> xt;
      const int64_t D = in[0].shape(-1);
      log_softmax(dense_data<float>(in[0], xt), in[0].size() / D, D, o.data<float>());
    });
  }
  const char* name() const override { return "Edge0LogSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

class RoPEOp : public DenseOp {
 public:
  RoPEOp(mx::Stream s, int dims, bool traditional, float base, float scale, int64_t offset)
      : DenseOp(s), dims_(dims), traditional_(traditional), base_(base), scale_(scale), offset_(offset) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [dims = dims_, trad = traditional_, base = base_, scale = scale_, offset = offset_](
                              const std::vector<mx::array>& in, mx::array& o) {
      std::vector<int32_t> ot;
      rope(view4(in[0]), dims, trad, base, scale, offset, o.data<float>(),
           in.size() > 1 ? dense_data<int32_t>(in[1], ot) : nullptr);
    });
  }
  const char* name() const override { return "Edge0RoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RoPEOp&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_ &&
           offset_ == o.offset_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
  int64_t offset_;
};

class LinearOp : public DenseOp {
 public:
  LinearOp(mx::Stream s, bool bias) : DenseOp(s), bias_(bias) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [bias = bias_](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<float> xt, wt, bt;
      std::vector<uint16_t> w16;
      const int64_t D = in[0].shape(-1), N = in[1].shape(0);
      const float* x = dense_data<float>(in[0], xt);
      const float* b = bias ? dense_data<float>(in[2], bt) : nullptr;
      if (in[1].dtype() == mx::bfloat16)
        linear(x, in[0].size() / D, dense_data<uint16_t>(in[1], w16), b, N, D, o.data<float>());
      else
        linear(x, in[0].size() / D, dense_data<float>(in[1], wt), b, N, D, o.data<float>());
    });
  }
  const char* name() const override { return "Edge0Linear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return bias_ == static_cast<const LinearOp&>(other).bias_;
  }

 private:
  bool bias_;
};

// An input of a node whose own node, not yet evaluated, runs inside it (one node fewer, the same bits): that node's
// primitive (Computes) and how many of the node's inputs, first, are its inputs.
struct Absorbed {
  std::shared_ptr<mx::Primitive> from;
  int inputs = 0;

  // the input's values: computed from the first `inputs` inputs, else in[own] as it is
  const float* values(const std::vector<mx::array>& in, size_t own, int64_t size, std::vector<float>& t) const {
    if (!from) return dense_data<float>(in[own], t);
    t.resize(size);
    dynamic_cast<const Computes&>(*from).compute({in.begin(), in.begin() + inputs}, t.data(), size);
    return t.data();
  }
  bool operator==(const Absorbed& o) const {
    return inputs == o.inputs && (from == o.from || (from && o.from && typeid(*from) == typeid(*o.from) &&
                                                     from->is_equivalent(*o.from)));
  }
  // "<its node>+<own>", or own: the name of the node taking it, built once when that node is made (the map's
  // strings outlive the node: a task may profile under it after the node is gone)
  const char* name(const char* own) const {
    if (!from) return own;
    // its node's name first: that node may have absorbed one too (a head running its router's product)
    const std::string n = std::string(from->name()) + "+" + (std::strncmp(own, "Edge0", 5) ? own : own + 5);
    static std::mutex mu;
    static std::map<std::string, std::string> names;  // a map's entries stay where they are
    std::lock_guard<std::mutex> lk(mu);
    return names.try_emplace(n, n).first->second.c_str();
  }
};

// a's node where the node taking a can run it (a float32 node of one output, not yet evaluated, that Computes)
static Absorbed absorbable_node(const mx::array& a) {
  if (a.status() != mx::array::Status::unscheduled || !a.siblings().empty() ||
      dynamic_cast<Computes*>(&a.primitive()) == nullptr)
    return {};
  return {a.primitive_ptr(), (int)whole_inputs(a).size()};
}

// the inputs of a node taking `a` first: a's node's inputs where it runs inside, else a
static std::vector<mx::array> leading(const mx::array& a, const Absorbed& p) {
  return p.from ? whole_inputs(a) : std::vector<mx::array>{a};
}

class HeadOp : public DenseOp, public Computes {
 public:
  HeadOp(mx::Stream s, bool prev, Absorbed router = {})
      : DenseOp(s), prev_(prev), router_(std::move(router)), name_(router_.name("Edge0Head")) {}

  // the head on its inputs, into o (rows of N logits)
  auto function() const {
    return [prev = prev_, rn = router_](const std::vector<mx::array>& in, float* o, int64_t N) {
      // in: x, now, [prev], router, delta, w1, b1, w2, b2; the router's product's inputs first, and no router,
      // where that product runs here
      const size_t b = rn.from ? rn.inputs : 0, p = prev ? 1 : 0, at = b + 2 + p, w = at + (rn.from ? 0 : 1);
      std::vector<float> xt, rt, dt, w1t, b1t, w2t, b2t;
      std::vector<uint16_t> d16, w116, w216;
      std::vector<uint32_t> nt, pt;
      const int64_t D = in[b].shape(-1), k = in[b + 1].shape(-1), H = in[w + 1].shape(0);
      const int64_t E = (in[w].shape(1) - D) / 2, T = in[b].size() / D;
      const float* x = dense_data<float>(in[b], xt);
      const uint32_t* now = dense_data<uint32_t>(in[b + 1], nt);
      const uint32_t* before = prev ? dense_data<uint32_t>(in[b + 2], pt) : nullptr;
      const float* router = rn.values(in, at, T * N, rt);
      const float* b1 = dense_data<float>(in[w + 2], b1t);
      const float* b2 = dense_data<float>(in[w + 4], b2t);
      if (in[w].dtype() == mx::bfloat16)  // all three weight matrices (head_op checks)
        head(x, now, before, T, (int)k, D, E, router, dense_data<uint16_t>(in[w], d16),
             dense_data<uint16_t>(in[w + 1], w116), b1, H, dense_data<uint16_t>(in[w + 3], w216), b2, N, o);
      else
        head(x, now, before, T, (int)k, D, E, router, dense_data<float>(in[w], dt), dense_data<float>(in[w + 1], w1t),
             b1, H, dense_data<float>(in[w + 3], w2t), b2, N, o);
    };
  }
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [fn = function()](const std::vector<mx::array>& in, mx::array& o) {
      fn(in, o.data<float>(), o.shape(-1));
    });
  }
  // (a SoftmaxTopK node deciding from the head's logits runs the head inside it)
  void compute(const std::vector<mx::array>& in, float* out, int64_t size) const override {
    const size_t b = router_.from ? router_.inputs : 0;
    function()(in, out, size / (in[b].size() / in[b].shape(-1)));
  }
  const char* name() const override { return name_; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const HeadOp&>(other);
    return prev_ == o.prev_ && router_ == o.router_ && held_ == o.held_;
  }

 private:
  bool prev_;
  Absorbed router_;  // the router's product, run here
  const char* name_;
};

class AttentionOp : public DenseOp {
 public:
  AttentionOp(mx::Stream s, float scale, bool causal) : DenseOp(s), scale_(scale), causal_(causal) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [scale = scale_, causal = causal_](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<int32_t> st;
      attention(view4(in[0]), view4(in[1]), view4(in[2]), scale, causal, o.data<float>(),
                in.size() > 3 ? dense_data<int32_t>(in[3], st) : nullptr);
    });
  }
  const char* name() const override { return "Edge0Attention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AttentionOp&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

class CombineOp : public DenseOp {
 public:
  using DenseOp::DenseOp;
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<float> yt, st;
      const int k = in[1].shape(-1);
      const int64_t D = in[0].shape(-1);
      combine(dense_data<float>(in[0], yt), dense_data<float>(in[1], st), in[1].size() / k, k, D, o.data<float>());
    });
  }
  const char* name() const override { return "Edge0Combine"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// An integer array's values as int64, in row-major order.
template <typename T>
static std::vector<int64_t> widened(const mx::array& a) {
  std::vector<T> tmp;
  const T* p = dense_data<T>(a, tmp);
  return std::vector<int64_t>(p, p + a.size());
}

// Rows of a quantized embedding table, one node (MLX composes mx.dequantize of a gathered row from about 30).
class EmbedOp : public DenseOp {
 public:
  EmbedOp(mx::Stream s, int group_size, int bits) : DenseOp(s), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [gs = group_size_, bits = bits_](const std::vector<mx::array>& in, mx::array& o) {
      const std::vector<int64_t> ids = in[0].dtype() == mx::uint32 ? widened<uint32_t>(in[0]) : widened<int32_t>(in[0]);
      std::vector<uint32_t> wt;
      std::vector<float> st, bt;
      const int64_t D = o.shape(-1);
      embed(ids.data(), (int64_t)ids.size(), dense_data<uint32_t>(in[1], wt), dense_data<float>(in[2], st),
            dense_data<float>(in[3], bt), in[1].shape(0), D, gs, bits, o.data<float>());
    });
  }
  const char* name() const override { return "Edge0Embed"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const EmbedOp&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && held_ == o.held_;
  }

 private:
  int group_size_, bits_;
};

// A node of several outputs: storage for each, then fn(inputs, outputs) on the stream, profiled under its name.
// fn sees the node's whole input list (held_: those it keeps itself).
class MultiOp : public mx::Primitive, public Holder {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }

 protected:
  template <typename F>
  void dispatch(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, F&& fn) {
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) enc.set_output_array(o);
    enc.dispatch([inputs = held_.all(inputs), outputs, fn = std::forward<F>(fn), name = name()]() mutable {
      ProfileScope scope([&] { return std::string(name); });
      fn(inputs, outputs);
    });
  }
};

// Routing as one node with two outputs: (inds uint32, scores float32), each (..., k), from the router's logits
// (..., E); where they are the router's product, not yet evaluated, that product runs here too.
class RouterOp : public MultiOp {
 public:
  RouterOp(mx::Stream s, int k, bool norm, int64_t E, Absorbed logits = {}, bool among = false)
      : MultiOp(s), k_(k), norm_(norm), E_(E), among_(among), logits_(std::move(logits)),
        name_(logits_.name("Edge0SoftmaxTopK")) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(inputs, outputs, [k = k_, norm = norm_, E = E_, among = among_, l = logits_](
                                  const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      std::vector<float> lt;
      std::vector<uint32_t> ct;
      const int64_t T = out[0].size() / k, M = among ? in.back().shape(-1) : 0;
      softmax_topk(l.values(in, 0, T * E, lt), T, E, k, norm, out[0].data<uint32_t>(), out[1].data<float>(),
                   among ? dense_data<uint32_t>(in.back(), ct) : nullptr, M);
    });
  }
  const char* name() const override { return name_; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const RouterOp&>(other);
    return k_ == o.k_ && norm_ == o.norm_ && E_ == o.E_ && among_ == o.among_ && logits_ == o.logits_ &&
           held_ == o.held_;
  }

 private:
  int k_;
  bool norm_;
  int64_t E_;
  bool among_;  // a last input (T, M) of candidate ids: the k are chosen among them
  Absorbed logits_;  // the router's product, run here
  const char* name_;
};

// A decode step's log-probabilities as one node: log_softmax (LogSoftmaxOp's function) of each row of x (B, 1, V),
// the step's logits, computed here where they are the LM head's product not yet evaluated (Absorbed); outputs (B, V)
// and the first row again as (V,) (what one sequence's step returns): no slice or squeeze node beside it.
class StepLogSoftmaxOp : public MultiOp {
 public:
  StepLogSoftmaxOp(mx::Stream s, Absorbed x) : MultiOp(s), x_(std::move(x)), name_(x_.name("Edge0LogSoftmax")) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(inputs, outputs, [xn = x_](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      const int64_t V = out[0].shape(-1), B = out[0].size() / V;
      std::vector<float> t;
      float* lp = out[0].data<float>();
      log_softmax(xn.values(in, 0, B * V, t), B, V, lp);
      std::copy(lp, lp + V, out[1].data<float>());
    });
  }
  const char* name() const override { return name_; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const StepLogSoftmaxOp&>(other);
    return x_ == o.x_ && held_ == o.held_;
  }

 private:
  Absorbed x_;  // the LM head's product, run here
  const char* name_;
};

// A decoder layer's residual add and the RMS norm after it as one node: h = x + r (MLX's Add, element by element)
// and rms_norm(h) (Edge0RMSNorm's bits). Inputs x, r (same shape), w (D,); outputs h, n. Where r is a node not yet
// evaluated that Computes (the attention block's output, the MoE block's combined experts), this node runs r's node
// itself (Absorbed): inputs r's inputs..., x, w; one node fewer, the same bits.
class AddRMSNormOp : public MultiOp {
 public:
  AddRMSNormOp(mx::Stream s, float eps, Absorbed r = {})
      : MultiOp(s), eps_(eps), r_(std::move(r)), name_(r_.name("Edge0AddRMSNorm")) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(inputs, outputs, [eps = eps_, rn = r_](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      run(in, out[0].data<float>(), out[1].data<float>(), out[0].size(), out[0].shape(-1), eps, rn);
    });
  }

  // the node's work on its inputs, into h and out (n values in rows of D)
  static void run(const std::vector<mx::array>& in, float* h, float* out, int64_t n, int64_t D, float eps,
                  const Absorbed& rn) {
    std::vector<float> xt, rt, wt;
    const size_t at = rn.from ? rn.inputs : 0;  // x, then r unless run here, then w
    add_norm(dense_data<float>(in[at], xt), rn.values(in, 1, n, rt), dense_data<float>(in[rn.from ? at + 1 : 2], wt),
             eps, n, D, h, out);
  }

  // h = x + r element by element, then out = rms_norm(h): n values in rows of D
  static void add_norm(const float* x, const float* r, const float* w, float eps, int64_t n, int64_t D, float* h,
                       float* out) {
    for (int64_t i = 0; i < n; i++) h[i] = x[i] + r[i];
    rms_norm(h, w, eps, n / D, D, out);
  }
  const char* name() const override { return name_; }  // Edge0GLU+AddRMSNorm running a GLU
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AddRMSNormOp&>(other);
    return eps_ == o.eps_ && r_ == o.r_;
  }

 private:
  float eps_;
  Absorbed r_;  // r's node, run here
  const char* name_;
};

// An MoE block of resident experts for the new token of each of T rows, as one node: the router's product, its
// softmax top-k (among the candidates, a last input, when given), the routed experts' SwiGLU, their weighted sum and
// the residual add with the RMS norm after it. Each part runs the function its own node runs (QMV, SoftmaxTopK,
// GLU+Combine, AddRMSNorm), in that order on the same values, so the bits of those four nodes, from one.
// With a recovery adapter's branch beside the block (lora_a, lora_b: two last inputs, and its scale), the experts' sum
// then takes the branch as AdaptAdd adds it (the same function), before the add-norm. With a table (E,) uint32, the
// experts are a slot bank's S slots and table[id] is the slot holding expert id (a streamed layer whose candidates
// were read a step ahead): the routed ids stay expert ids, their products read the slots.
// Inputs: x, router (w, scales, biases), gate, up, down (w, scales, biases each), h, norm weight[, among][, table]
// [, lora_a, lora_b]; outputs: h + the experts' sum, its norm, the routed ids (T.., k) and their weights.
class MoeBlockOp : public MultiOp {
 public:
  MoeBlockOp(mx::Stream s, int router_gs, int k, bool norm_topk, bool among, bool table, int gs, float eps,
             float branch)
      : MultiOp(s), router_gs_(router_gs), k_(k), norm_topk_(norm_topk), among_(among), table_(table), gs_(gs),
        eps_(eps), branch_(branch) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(inputs, outputs, [rgs = router_gs_, k = k_, norm = norm_topk_, among = among_, table = table_, gs = gs_,
                               eps = eps_, branch = branch_](const std::vector<mx::array>& in,
                                                             std::vector<mx::array>& out) {
      const int64_t D = in[0].shape(-1), T = in[0].size() / D, E = in[1].shape(-2), N = in[10].shape(-2);
      std::vector<float> logits(T * E), y(T * N), ht, wt;
      QMV::run({in[0], in[1], in[2], in[3]}, logits.data(), T * E, rgs, 1, false, false, false);
      std::vector<uint32_t> ct;
      softmax_topk(logits.data(), T, E, k, norm, out[2].data<uint32_t>(), out[3].data<float>(),
                   among ? dense_data<uint32_t>(in[15], ct) : nullptr, among ? in[15].shape(-1) : 0);
      std::vector<mx::array> glu{in[0], in[4], in[5], in[6], in[7], in[8], in[9], in[10], in[11], in[12], out[2],
                                 out[3]};
      std::vector<uint32_t> tt;
      QMV::run(glu, y.data(), T * N, gs, k, true, true, true,
               table ? dense_data<uint32_t>(in[15 + among], tt) : nullptr);
      if (branch != 0.f) {
        std::vector<float> xt;
        const size_t at = in.size() - 2;
        adapt_arrays(dense_data<float>(in[0], xt), T, D, in[at], in[at + 1], branch, y.data());
      }
      AddRMSNormOp::add_norm(dense_data<float>(in[13], ht), y.data(), dense_data<float>(in[14], wt), eps, T * N, N,
                             out[0].data<float>(), out[1].data<float>());
    });
  }
  const char* name() const override { return "Edge0MoeBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const MoeBlockOp&>(other);
    return router_gs_ == o.router_gs_ && k_ == o.k_ && norm_topk_ == o.norm_topk_ && among_ == o.among_ &&
           table_ == o.table_ && gs_ == o.gs_ && eps_ == o.eps_ && branch_ == o.branch_ && held_ == o.held_;
  }

 private:
  int router_gs_, k_;
  bool norm_topk_, among_, table_;
  int gs_;
  float eps_, branch_;  // branch_: the adapter branch's scale (0: none)
};

// y + scale * (x A) B for rows of y (N) and x (D): a recovery adapter's branch beside a block whose output is y
// (an MoE block's experts' sum), added in y's place by the function qmv_lora adds its branch with.
class AdaptAdd : public mx::UnaryPrimitive {
 public:
  AdaptAdd(mx::Stream s, float scale) : mx::UnaryPrimitive(s), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, scale = scale_]() mutable {
      ProfileScope scope([] { return std::string("Edge0AdaptAdd"); });
      std::vector<float> yt, xt;
      const int64_t D = inputs[1].shape(-1), R = inputs[1].size() / D;
      const float* y = dense_data<float>(inputs[0], yt);
      std::copy(y, y + out.size(), out.data<float>());
      adapt_arrays(dense_data<float>(inputs[1], xt), R, D, inputs[2], inputs[3], scale, out.data<float>());
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }
  const char* name() const override { return "Edge0AdaptAdd"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const AdaptAdd&>(other).scale_;
  }

 private:
  float scale_;
};

// One new token's attention in a decoder layer, of one sequence or of each of a batch, as three nodes where
// mlx-lm's code builds 17 (its reshapes, transposes, slice updates and slices among them): Edge0KVWrite puts the
// token's k row (RMS-normed per head and rotated) and its v row at row `offset` of the KV cache's buffers
// (B, Hkv, C, Dh); Edge0DecodeAttention norms and rotates the token's q and attends to the buffers' first
// offset + 1 rows. A batch (mlx-lm's left-padded BatchKVCache) writes every sequence's row at the same `offset`,
// rotates each at its own position (`positions`, (B,) int32) and starts each sequence's attention at its own
// first key (`starts`). A buffer that nothing else holds is written in place (its storage passes to the output,
// as MLX's slice update does), else copied first.
// Each step is the function the separate nodes call, so the results are theirs bit for bit.
static std::atomic<int64_t> kv_copies{0};

// Whether buf can pass its storage on to the node now being evaluated. A step built while the step before it
// computes (overlapped decode) is evaluated here while that step's tasks that read buf may still be queued on the
// stream, holding it until they have run: then wait, until buf is free or until a marker queued behind them has run
// (every task queued before it done). A holder that is no queued task (a prompt cache's copy, a caller's
// reference) still holds it then, and the buffer is copied. Without the wait the cache was copied, whole, at a
// share of the steps that depended on how far ahead the graph-building thread ran.
static bool donatable(const mx::array& buf, mx::Stream s) {
  if (buf.is_donatable()) return true;
  if (!buf.data_shared_ptr() || !buf.data_shared_ptr()->is_owned()) return false;
  auto ran = std::make_shared<std::atomic<bool>>(false);
  mx::cpu::get_command_encoder(s).dispatch([ran] { ran->store(true, std::memory_order_release); });
  for (;;) {
    const bool drained = ran->load(std::memory_order_acquire);  // before the check: its tasks are then gone
    if (buf.is_donatable()) return true;
    if (drained) return false;
    std::this_thread::yield();
  }
}

// B sequences' heads of Dh values, contiguous: RMS-normed (w given) then rotated (dims > 0) at `offset`, or at
// positions[b] for sequence b, into out.
static void norm_rotate(const float* x, const float* w, float eps, int64_t B, int64_t heads, int64_t Dh, int dims,
                        bool trad, float base, float scale, int64_t offset, const int32_t* positions, float* out) {
  std::vector<float> n;
  const float* src = x;
  if (w) {
    n.resize(B * heads * Dh);
    rms_norm(x, w, eps, B * heads, Dh, n.data());
    src = n.data();
  }
  if (dims > 0)
    rope(View4{src, {B, heads, 1, Dh}, {heads * Dh, Dh, Dh, 1}}, dims, trad, base, scale, offset, out, positions);
  else if (src != out)
    std::copy(src, src + B * heads * Dh, out);
}

struct Rotation {
  bool norm, positions;  // inputs: a norm weight; per-sequence positions (else every sequence at offset)
  float eps;
  int dims;  // 0: no rotation
  bool traditional;
  float base, scale;
  bool operator==(const Rotation& o) const {
    return norm == o.norm && positions == o.positions && eps == o.eps && dims == o.dims &&
           traditional == o.traditional && base == o.base && scale == o.scale;
  }
};

// The n values the KV write or the attention starts from: input 0, or the output of the projection leading the
// inputs (Projection), run here into t. next: the index of the first input after them.
static const float* rows_input(const std::vector<mx::array>& in, const Projection& p, int64_t n, std::vector<float>& t,
                               size_t& next) {
  next = p.inputs ? p.inputs : 1;
  if (!p.inputs) return dense_data<float>(in[0], t);
  t.resize(n);
  project(in, p, t.data());
  return t.data();
}

// Writes the new rows of a KV write (inputs: the rows, or the projection making them[, norm][, positions], buffer)
// into dst, the buffer's storage or a fresh one (copy: the buffer's values copied into it first).
static void write_rows(const std::vector<mx::array>& in, bool copy, float* dst, int64_t offset, const Rotation& r,
                       const Projection& p) {
  const auto& buf = in.back();
  const int64_t B = buf.shape(0), H = buf.shape(1), C = buf.shape(2), Dh = buf.shape(3);
  if (copy) {
    std::vector<float> t;
    const float* src = dense_data<float>(buf, t);
    std::copy(src, src + buf.size(), dst);
  }
  std::vector<float> xt, wt, row(B * H * Dh);
  std::vector<int32_t> pt;
  size_t at;  // in[at]: the first input after the rows
  const float* x = rows_input(in, p, B * H * Dh, xt, at);
  norm_rotate(x, r.norm ? dense_data<float>(in[at], wt) : nullptr, r.eps, B, H, Dh, r.dims, r.traditional, r.base,
              r.scale, offset, r.positions ? dense_data<int32_t>(in[at + r.norm], pt) : nullptr, row.data());
  for (int64_t bh = 0; bh < B * H; bh++)
    std::copy(row.data() + bh * Dh, row.data() + (bh + 1) * Dh, dst + (bh * C + offset) * Dh);
}

// out takes buf's storage where buf can pass it on, else fresh storage; whether buf must be copied into it.
static bool take_buffer(const mx::array& buf, mx::array& out, mx::Stream s) {
  if (buf.flags().row_contiguous && buf.data_size() == buf.size() && donatable(buf, s)) {
    out.copy_shared_buffer(buf);
    return false;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  kv_copies.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Inputs: x (B*Hkv*Dh values)[, norm (Dh,)][, positions (B,)], buffer (B, Hkv, C, Dh); output: the buffer with
// row offset of every sequence written.
class KVWriteOp : public DenseOp {
 public:
  KVWriteOp(mx::Stream s, int64_t offset, Rotation r, Projection p) : DenseOp(s), offset_(offset), r_(r), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const bool copy = take_buffer(inputs.back(), out, stream());
    run(inputs, out, [copy, offset = offset_, r = r_, p = p_](const std::vector<mx::array>& in, mx::array& o) {
      write_rows(in, copy, o.data<float>(), offset, r, p);
    });
  }
  const char* name() const override { return "Edge0KVWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const KVWriteOp&>(other);
    return offset_ == o.offset_ && r_ == o.r_ && p_ == o.p_;
  }

 private:
  int64_t offset_;
  Rotation r_;
  Projection p_;
};

// A layer's two KV writes, the keys' then the values' (each the function of its Edge0KVWrite), for a node that runs
// them: its inputs start with the keys write's (the last of them the keys buffer, `nk` in all), then the values'.
struct KVPair {
  int64_t offset;
  size_t nk;
  Rotation rk;
  Projection pk, pv;

  // the keys' rows into keys, the values' into values (each buffer copied in first where it could not pass its
  // storage on)
  auto writer() const {
    return [offset = offset, nk = nk, rk = rk, pk = pk, pv = pv](const std::vector<mx::array>& in, bool ck, bool cv,
                                                                 float* keys, float* values) {
      write_rows({in.begin(), in.begin() + nk}, ck, keys, offset, rk, pk);
      write_rows({in.begin() + nk, in.end()}, cv, values, offset, Rotation{}, pv);
    };
  }
  bool operator==(const KVPair& o) const {
    return offset == o.offset && nk == o.nk && rk == o.rk && pk == o.pk && pv == o.pv;
  }
};

// A layer's attention block for a new token, as one node: the two KV writes (KVPair), then the
// add-norm that runs the attention and its output projection (AddRMSNormOp's work, on the buffers just written), so
// the bits of those two nodes. Inputs: the pair's (`np`), then the add-norm's without the two buffers it reads
// (which stood at `at` and `at + 1`); outputs: h + attention, its norm, the keys and values buffers.
class AttentionBlockOp : public MultiOp {
 public:
  AttentionBlockOp(mx::Stream s, KVPair pair, size_t np, float eps, Absorbed attention, size_t at)
      : MultiOp(s), pair_(pair), np_(np), eps_(eps), attention_(std::move(attention)), at_(at) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // Each output of a node keeps its own list of the node's inputs (mx::array::make_arrays), so a buffer is held
    // once a list and never donatable: the other outputs' lists go now (MLX clears them all once the node is
    // evaluated), so that the cache's buffers can pass on.
    for (auto& o : outputs)
      if (&o.inputs() != &inputs) o.inputs().clear();
    const bool ck = take_buffer(inputs[held_.seen_at(pair_.nk - 1)], outputs[2], stream());
    const bool cv = take_buffer(inputs[held_.seen_at(np_ - 1)], outputs[3], stream());
    for (size_t i : {size_t(0), size_t(1)}) outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    for (auto& o : outputs) enc.set_output_array(o);
    enc.dispatch([inputs = held_.all(inputs), outputs, ck, cv, write = pair_.writer(), np = np_, eps = eps_,
                  rn = attention_,
                  at = at_]() mutable {
      ProfileScope scope([] { return std::string("Edge0AttentionBlock"); });
      write({inputs.begin(), inputs.begin() + np}, ck, cv, outputs[2].data<float>(), outputs[3].data<float>());
      std::vector<mx::array> in(inputs.begin() + np, inputs.end());
      in.insert(in.begin() + at, {outputs[2], outputs[3]});
      AddRMSNormOp::run(in, outputs[0].data<float>(), outputs[1].data<float>(), outputs[0].size(),
                        outputs[0].shape(-1), eps, rn);
    });
  }
  const char* name() const override { return "Edge0AttentionBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AttentionBlockOp&>(other);
    return np_ == o.np_ && at_ == o.at_ && pair_ == o.pair_ && eps_ == o.eps_ && attention_ == o.attention_ &&
           held_ == o.held_;
  }

 private:
  KVPair pair_;
  size_t np_;
  float eps_;  // the add-norm's
  Absorbed attention_;  // the attention with its output projection, which the add-norm runs
  size_t at_;
};

// Inputs: q (B*heads*Dh values)[, norm (Dh,)][, positions (B,)][, starts (B,)], keys, values (B, Hkv, C, Dh);
// output (B, 1, heads*Dh): the heads side by side, as the output projection takes them.
class DecodeAttentionOp : public DenseOp, public Computes {
 public:
  DecodeAttentionOp(mx::Stream s, int64_t offset, Rotation r, bool starts, float scale, Projection p,
                    Projection out = {})
      : DenseOp(s), offset_(offset), r_(r), starts_(starts), scale_(scale), p_(p), out_(out) {}

  // the node's work on its inputs, into o
  auto function() const {
    return [offset = offset_, r = r_, starts = starts_, scale = scale_, p = p_, op = out_](
                  const std::vector<mx::array>& in, float* o) {
      const size_t kv = in.size() - 2 - (op.inputs ? op.inputs - 1 : 0);  // keys, values; the out projection's weights
      const auto& keys = in[kv];
      const auto& values = in[kv + 1];
      const int64_t B = keys.shape(0), Hkv = keys.shape(1), C = keys.shape(2), Dh = keys.shape(3);
      size_t first;
      std::vector<float> xt, wt, kt, vt;
      const int64_t Hq = p.inputs ? in[1].shape(-2) / Dh : in[0].size() / (B * Dh);  // the q rows' heads
      std::vector<float> qr(B * Hq * Dh), heads(op.inputs ? B * Hq * Dh : 0);
      std::vector<int32_t> pt, st;
      const float* x = rows_input(in, p, B * Hq * Dh, xt, first);
      const size_t at = first + r.norm;  // the first integer input
      norm_rotate(x, r.norm ? dense_data<float>(in[first], wt) : nullptr, r.eps, B, Hq, Dh, r.dims,
                  r.traditional, r.base, r.scale, offset, r.positions ? dense_data<int32_t>(in[at], pt) : nullptr,
                  qr.data());
      const float* kc = dense_data<float>(keys, kt);  // the KV writes' outputs: contiguous
      const float* vc = dense_data<float>(values, vt);
      const int64_t S = offset + 1;
      attention(View4{qr.data(), {B, Hq, 1, Dh}, {Hq * Dh, Dh, Dh, 1}},
                View4{kc, {B, Hkv, S, Dh}, {Hkv * C * Dh, C * Dh, Dh, 1}},
                View4{vc, {B, Hkv, S, Dh}, {Hkv * C * Dh, C * Dh, Dh, 1}}, scale, false,
                op.inputs ? heads.data() : o, starts ? dense_data<int32_t>(in[at + r.positions], st) : nullptr);
      if (op.inputs) project_rows(heads.data(), B, Hq * Dh, in, kv + 2, op, o);
    };
  }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(inputs, out, [fn = function()](const std::vector<mx::array>& in, mx::array& o) { fn(in, o.data<float>()); });
  }
  void compute(const std::vector<mx::array>& in, float* out, int64_t) const override { function()(in, out); }
  const char* name() const override { return "Edge0DecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const DecodeAttentionOp&>(other);
    return offset_ == o.offset_ && r_ == o.r_ && starts_ == o.starts_ && scale_ == o.scale_ && p_ == o.p_ &&
           out_ == o.out_;
  }
  // this node with the projection of its output run inside it as well
  std::shared_ptr<DecodeAttentionOp> then(const Projection& out) {
    return out_.inputs ? nullptr : std::make_shared<DecodeAttentionOp>(stream(), offset_, r_, starts_, scale_, p_, out);
  }

 private:
  int64_t offset_;
  Rotation r_;
  bool starts_;
  float scale_;
  Projection p_, out_;  // the q projection run first; the output projection run last
};

static std::optional<mx::array> attention_then(const mx::array& x, const std::vector<mx::array>& weights,
                                               const Projection& p, const mx::Shape& shape) {
  auto* att = x.status() == mx::array::Status::unscheduled ? dynamic_cast<DecodeAttentionOp*>(&x.primitive()) : nullptr;
  auto fused = att ? att->then(p) : nullptr;
  if (!fused) return std::nullopt;
  auto in = whole_inputs(x);
  in.insert(in.end(), weights.begin(), weights.end());
  return mx::array(shape, mx::float32, fused, std::move(in));
}

static void need_f32(const mx::array& a, const char* op, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string("edge0 ") + op + ": " + what + " must be float32");
}

// exp or erf of every element as the kernels compute them, evaluated here (not a graph node): the tests compare
// them bit for bit with mx.exp and mx.erf.
static mx::array math_op(mx::array x, const std::string& fn) {
  need_f32(x, "math", "x");
  if (fn != "exp" && fn != "erf") throw std::invalid_argument("edge0 math: fn must be \"exp\" or \"erf\"");
  x = mx::contiguous(x);
  x.eval();
  std::vector<float> y(x.size());
  (fn == "exp" ? exp_mlx : erf_mlx)(x.data<float>(), y.data(), (int64_t)x.size());
  return mx::array(y.begin(), x.shape(), mx::float32);
}

// a node of op over `in`, keeping the evaluated arrays of `in` itself (Holder)
template <typename Op>
static mx::array held_node(const mx::Shape& shape, mx::Dtype dtype, std::shared_ptr<Op> op, std::vector<mx::array> in) {
  op->hold(in);
  return mx::array(shape, dtype, std::move(op), std::move(in));
}

template <typename Op>
static std::vector<mx::array> held_nodes(std::vector<mx::Shape> shapes, std::vector<mx::Dtype> dtypes,
                                         std::shared_ptr<Op> op, std::vector<mx::array> in) {
  op->hold(in);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), std::move(op), std::move(in));
}

static mx::array rms_norm_op(const mx::array& x, const mx::array& w, float eps) {
  need_f32(x, "rms_norm", "x");
  need_f32(w, "rms_norm", "weight");
  if (x.ndim() < 1 || x.shape(-1) < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("edge0 rms_norm: weight must be (D,) for x (..., D), D >= 1");
  auto s = mx::default_stream(mx::Device::cpu);
  return held_node(x.shape(), mx::float32, std::make_shared<RMSNormOp>(s, eps), {x, w});
}

static mx::array log_softmax_op(const mx::array& x) {
  need_f32(x, "log_softmax", "x");
  if (x.ndim() < 1 || x.shape(-1) < 1) throw std::invalid_argument("edge0 log_softmax: x (..., D), D >= 1");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<LogSoftmaxOp>(s), {x});
}

static std::vector<mx::array> step_log_softmax_op(const mx::array& x) {
  need_f32(x, "step_log_softmax", "x");
  if (x.ndim() != 3 || x.shape(1) != 1 || x.shape(0) < 1 || x.shape(2) < 1)
    throw std::invalid_argument("edge0 step_log_softmax: x (B, 1, V), a step's logits");
  auto s = mx::default_stream(mx::Device::cpu);
  const Absorbed from = absorbable_node(x);  // the LM head's product runs inside this node
  return held_nodes({{x.shape(0), x.shape(2)}, {x.shape(2)}}, {mx::float32, mx::float32},
                    std::make_shared<StepLogSoftmaxOp>(s, from), leading(x, from));
}

static std::vector<mx::array> add_rms_norm_op(const mx::array& x, const mx::array& r, const mx::array& w, float eps) {
  need_f32(x, "add_rms_norm", "x");
  need_f32(r, "add_rms_norm", "r");
  need_f32(w, "add_rms_norm", "weight");
  if (x.shape() != r.shape() || x.ndim() < 1 || x.shape(-1) < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1))
    throw std::invalid_argument("edge0 add_rms_norm: x and r of one shape (..., D), weight (D,), D >= 1");
  auto s = mx::default_stream(mx::Device::cpu);
  const Absorbed from = absorbable_node(r);  // r's node runs inside this one
  std::vector<mx::array> in = from.from ? leading(r, from) : std::vector<mx::array>{x, r};
  if (from.from) in.push_back(x);
  in.push_back(w);
  return mx::array::make_arrays({x.shape(), x.shape()}, {mx::float32, mx::float32},
                                std::make_shared<AddRMSNormOp>(s, eps, from), std::move(in));
}

static mx::array linear_op(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  need_f32(x, "linear", "x");
  if (w.dtype() != mx::bfloat16) need_f32(w, "linear", "weight (or bfloat16)");
  if (bias) need_f32(*bias, "linear", "bias");
  if (x.ndim() < 1 || x.shape(-1) < 1 || w.ndim() != 2 || w.shape(1) != x.shape(-1) ||
      (bias && (bias->ndim() != 1 || bias->shape(0) != w.shape(0))))
    throw std::invalid_argument("edge0 linear: weight must be (N, D) and bias (N,) for x (..., D), D >= 1");
  auto shape = x.shape();
  shape.back() = w.shape(0);
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> in{x, w};
  if (bias) in.push_back(*bias);
  return mx::array(shape, mx::float32, std::make_shared<LinearOp>(s, (bool)bias), in);
}

static mx::array head_op(const mx::array& x, const mx::array& now, const std::optional<mx::array>& prev,
                         const mx::array& router, const mx::array& delta, const mx::array& w1, const mx::array& b1,
                         const mx::array& w2, const mx::array& b2) {
  for (auto* a : {&x, &router, &b1, &b2}) need_f32(*a, "head", "x, router and the biases");
  for (auto* a : {&delta, &w2})
    if (a->dtype() != w1.dtype() || (w1.dtype() != mx::float32 && w1.dtype() != mx::bfloat16))
      throw std::invalid_argument("edge0 head: delta, w1 and w2 must be all float32 or all bfloat16");
  const bool ok_ids = now.dtype() == mx::uint32 && (!prev || (prev->dtype() == mx::uint32 && prev->shape() == now.shape()));
  const int64_t D = x.ndim() ? x.shape(-1) : 0, N = router.ndim() ? router.shape(-1) : 0;
  const int64_t rows = D ? x.size() / D : 0;
  if (!ok_ids || x.ndim() < 1 || D < 1 || now.ndim() < 1 || now.shape(-1) < 1 || now.size() / now.shape(-1) != rows ||
      router.size() != rows * N || delta.ndim() != 2 || delta.shape(0) != N || delta.shape(1) <= D ||
      (delta.shape(1) - D) % 2 || w1.ndim() != 2 || w1.shape(1) != delta.shape(1) || b1.ndim() != 1 ||
      b1.shape(0) != w1.shape(0) || w2.ndim() != 2 || w2.shape(0) != N || w2.shape(1) != w1.shape(0) ||
      b2.ndim() != 1 || b2.shape(0) != N)
    throw std::invalid_argument(
        "edge0 head: x (..., D), now and prev (..., k) uint32, router (..., N), delta (N, D + 2E), w1 (H, D + 2E), "
        "b1 (H,), w2 (N, H), b2 (N,)");
  auto s = mx::default_stream(mx::Device::cpu);
  const Absorbed from = absorbable_node(router);  // the router's product runs inside this node
  std::vector<mx::array> in = from.from ? whole_inputs(router) : std::vector<mx::array>{};
  in.push_back(x);
  in.push_back(now);
  if (prev) in.push_back(*prev);
  if (!from.from) in.push_back(router);
  for (auto* a : {&delta, &w1, &b1, &w2, &b2}) in.push_back(*a);
  return held_node(router.shape(), mx::float32, std::make_shared<HeadOp>(s, (bool)prev, from), std::move(in));
}

static std::vector<mx::array> softmax_topk_op(const mx::array& logits, int k, bool norm,
                                              std::optional<mx::array> among) {
  need_f32(logits, "softmax_topk", "logits");
  if (logits.ndim() < 1 || k < 1 || k > logits.shape(-1))
    throw std::invalid_argument("edge0 softmax_topk: logits (..., E) and 1 <= k <= E");
  if (among && (among->dtype() != mx::uint32 || among->ndim() != logits.ndim() || among->shape(-1) < k ||
                among->size() / among->shape(-1) != logits.size() / logits.shape(-1)))
    throw std::invalid_argument("edge0 softmax_topk: among must be uint32 (..., M), M >= k, a row per logits row");
  auto shape = logits.shape();
  shape.back() = k;
  auto s = mx::default_stream(mx::Device::cpu);
  const Absorbed from = absorbable_node(logits);  // the router's product runs inside this node
  auto in = leading(logits, from);
  if (among) in.push_back(*among);
  return held_nodes({shape, shape}, {mx::uint32, mx::float32},
                    std::make_shared<RouterOp>(s, k, norm, logits.shape(-1), from, (bool)among), std::move(in));
}

static mx::array combine_op(const mx::array& y, const mx::array& scores) {
  need_f32(y, "combine", "y");
  need_f32(scores, "combine", "scores");
  if (y.ndim() < 2 || y.shape(-2) < 1 || scores.shape() != mx::Shape(y.shape().begin(), y.shape().end() - 1))
    throw std::invalid_argument("edge0 combine: y (..., K, D) and scores (..., K), K >= 1");
  auto shape = scores.shape();
  shape.back() = y.shape(-1);
  // y the routed experts' GLU node, not yet evaluated: one node that runs it and sums its rows (the same bits)
  if (auto* glu = y.status() == mx::array::Status::unscheduled ? dynamic_cast<QMV*>(&y.primitive()) : nullptr;
      glu && glu->combinable() && y.inputs().back().size() == scores.size()) {
    auto in = y.inputs();
    in.push_back(scores);
    return mx::array(shape, mx::float32, glu->combined(), std::move(in));
  }
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(shape, mx::float32, std::make_shared<CombineOp>(s), {y, scores});
}

static mx::array embed_op(const mx::array& ids, const mx::array& w, const mx::array& scales, const mx::array& biases,
                          int group_size, int bits) {
  need_f32(scales, "embed", "scales");
  need_f32(biases, "embed", "biases");
  if (ids.dtype() != mx::uint32 && ids.dtype() != mx::int32)
    throw std::invalid_argument("edge0 embed: ids must be uint32 or int32");
  if (bits != 4 && bits != 8) throw std::invalid_argument("edge0 embed: bits must be 4 or 8");
  const int64_t D = w.ndim() == 2 ? w.shape(1) * (32 / bits) : 0;
  if (w.dtype() != mx::uint32 || D < 1 || group_size < 1 || D % group_size || scales.ndim() != 2 ||
      scales.shape(0) != w.shape(0) || scales.shape(1) != D / group_size || biases.shape() != scales.shape())
    throw std::invalid_argument("edge0 embed: w (V, D*bits/32) uint32, scales and biases (V, D/group_size)");
  auto shape = ids.shape();
  shape.push_back((int)D);
  auto s = mx::default_stream(mx::Device::cpu);
  return held_node(shape, mx::float32, std::make_shared<EmbedOp>(s, group_size, bits), {ids, w, scales, biases});
}

static void need_rows(const std::optional<mx::array>& a, int64_t B, const char* op, const char* what);

// B sequences' rows of a decode token (heads of Dh values each), their optional norm weight and per-sequence
// positions, checked; returns the inputs so far.
static std::vector<mx::array> head_rows(const char* op, const mx::array& x, const std::optional<mx::array>& norm,
                                        const std::optional<mx::array>& positions, int64_t B, int64_t heads,
                                        int64_t Dh, int dims) {
  need_f32(x, op, "the rows");
  if (heads < 1 || Dh < 1 || x.size() != B * heads * Dh || dims < 0 || dims % 2 || dims > Dh)
    throw std::invalid_argument(std::string("edge0 ") + op + ": " + std::to_string(B) + " x " +
                                std::to_string(heads) + " heads of " + std::to_string(Dh) +
                                " values expected, and rope dims even, at most Dh (0: none)");
  std::vector<mx::array> in{x};
  if (norm) {
    need_f32(*norm, op, "the norm weight");
    if (norm->ndim() != 1 || norm->shape(0) != Dh)
      throw std::invalid_argument(std::string("edge0 ") + op + ": norm weight (Dh,)");
    in.push_back(*norm);
  }
  need_rows(positions, B, op, "positions");
  if (positions) in.push_back(*positions);
  return in;
}

// x's projection when x is a plain projection node not yet evaluated (Projection: the node taking x runs it, one
// node fewer); none (inputs 0) otherwise. absorb puts its inputs in x's place.
static Projection absorbable(const mx::array& x) {
  if (x.status() != mx::array::Status::unscheduled) return {};
  if (auto* p = dynamic_cast<QMVLoRA*>(&x.primitive())) return p->projection();
  if (auto* p = dynamic_cast<QMV*>(&x.primitive())) return p->projection();
  return {};
}

static void absorb(std::vector<mx::array>& in, const mx::array& x, const Projection& p) {
  if (!p.inputs) return;
  const auto xin = whole_inputs(x);
  in.erase(in.begin());
  in.insert(in.begin(), xin.begin(), xin.end());
}

static bool is_cache_buffer(const mx::array& b) { return b.ndim() == 4 && b.shape(0) >= 1 && b.dtype() == mx::float32; }

static mx::array kv_write_op(const mx::array& x, const std::optional<mx::array>& norm, const mx::array& buffer,
                             int64_t offset, float eps, int dims, bool traditional, float base, float rope_scale,
                             const std::optional<mx::array>& positions) {
  if (!is_cache_buffer(buffer) || offset < 0 || offset >= buffer.shape(2))
    throw std::invalid_argument("edge0 kv_write: buffer (B, H, C, Dh) float32 and 0 <= offset < C");
  auto in = head_rows("kv_write", x, norm, positions, buffer.shape(0), buffer.shape(1), buffer.shape(3), dims);
  in.push_back(buffer);
  const Projection p = absorbable(x);
  absorb(in, x, p);
  auto s = mx::default_stream(mx::Device::cpu);
  const Rotation r{(bool)norm, (bool)positions, eps, dims, traditional, base, rope_scale};
  return mx::array(buffer.shape(), mx::float32, std::make_shared<KVWriteOp>(s, offset, r, p), in);
}

static mx::array decode_attention_op(const mx::array& q, const std::optional<mx::array>& norm, const mx::array& keys,
                                     const mx::array& values, int64_t offset, float eps, int dims, bool traditional,
                                     float base, float rope_scale, float scale,
                                     const std::optional<mx::array>& positions,
                                     const std::optional<mx::array>& starts) {
  const int64_t B = keys.ndim() == 4 ? keys.shape(0) : 1, Dh = keys.ndim() == 4 ? keys.shape(3) : 1;
  if (!is_cache_buffer(keys) || keys.shape() != values.shape() || values.dtype() != mx::float32 || offset < 0 ||
      offset >= keys.shape(2) || Dh < 1 || q.size() % (B * Dh) || (q.size() / (B * Dh)) % keys.shape(1))
    throw std::invalid_argument(
        "edge0 decode_attention: keys and values (B, Hkv, C, Dh) float32, 0 <= offset < C, q B x a multiple of Hkv "
        "heads of Dh");
  const int64_t heads = q.size() / (B * Dh);
  auto in = head_rows("decode_attention", q, norm, positions, B, heads, Dh, dims);
  need_rows(starts, B, "decode_attention", "starts");
  if (starts) in.push_back(*starts);
  in.push_back(keys);
  in.push_back(values);
  const Projection p = absorbable(q);
  absorb(in, q, p);
  auto s = mx::default_stream(mx::Device::cpu);
  const Rotation r{(bool)norm, (bool)positions, eps, dims, traditional, base, rope_scale};
  return mx::array(mx::Shape{(int)B, 1, (int)(heads * Dh)}, mx::float32,
                   std::make_shared<DecodeAttentionOp>(s, offset, r, (bool)starts, scale, p), in);
}

// One new token's whole attention block for one sequence (or a left-padded batch: positions, each sequence's
// rotation offset, and starts, its first key, as decode_attention takes them): its k, v and q projections, the two
// KV writes, the attention, the output projection and the residual add with the RMS norm after it, as one node
// (AttentionBlockOp) with the bits of the nodes decode_attention and add_norm of compute/dense.py build, from one
// call instead of seven (each call from Python costs microseconds). Returns (h + attention, its norm, the keys
// buffer, the values buffer).
static std::vector<mx::array> attention_block_op(const mx::array& x, const mx::array& h,
                                                 const std::vector<mx::array>& q, const std::vector<mx::array>& k,
                                                 const std::vector<mx::array>& v, const std::vector<mx::array>& o,
                                                 float lora_scale, int group_size, const mx::array& q_norm,
                                                 float q_eps, const mx::array& k_norm, float k_eps,
                                                 const mx::array& keys, const mx::array& values, int64_t offset,
                                                 int dims, bool traditional, float base, float rope_scale, float scale,
                                                 const mx::array& post_norm, float post_eps,
                                                 const std::optional<mx::array>& positions,
                                                 const std::optional<mx::array>& starts) {
  // The node's inputs are laid out as the nodes kv_write_op, decode_attention_op, the output projection and
  // add_rms_norm_op would build them (their projections absorbed), checked as they check them.
  auto bad = [](const std::string& what) { throw std::invalid_argument("edge0 attention_block: " + what); };
  const int64_t rows = check_x(x, group_size), D = x.shape(-1);
  auto proj = [&](const std::vector<mx::array>& p, int64_t width, const char* name) {
    if (p.size() != 3 && p.size() != 5) bad(std::string(name) + " is (w, scales, biases[, lora_a, lora_b])");
    const int64_t N = check_weights(p[0], p[1], p[2], width, group_size);
    if (p[0].ndim() != 2) bad(std::string(name) + ": w must be (N, D*bits/32)");
    if (p.size() == 5 && !lora_fits(p[3], p[4], width, N))
      bad(std::string(name) + ": lora_a must be (D, r) and lora_b (r, N), both float32 or both bfloat16");
    return std::make_pair(Projection{(int)p.size() + 1, group_size, p.size() == 5 ? lora_scale : 0.f}, N);
  };
  const auto [pq, Nq] = proj(q, D, "q");
  const auto [pk, Nk] = proj(k, D, "k");
  const auto [pv, Nv] = proj(v, D, "v");
  const auto [po, No] = proj(o, Nq, "o");
  if (!is_cache_buffer(keys) || keys.shape() != values.shape() || values.dtype() != mx::float32 || offset < 0 ||
      offset >= keys.shape(2))
    bad("keys and values (B, Hkv, C, Dh) float32, 0 <= offset < C");
  const int64_t B = keys.shape(0), Hkv = keys.shape(1), Dh = keys.shape(3);
  if (rows != B || Nk != Hkv * Dh || Nv != Hkv * Dh || Nq % (Hkv * Dh) != 0)
    bad("x a row per sequence, k and v projections to Hkv heads of Dh, q to a multiple of them");
  if (dims < 0 || dims % 2 || dims > Dh) bad("rope dims even, at most Dh (0: none)");
  for (auto* n : {&q_norm, &k_norm})
    if (n->dtype() != mx::float32 || n->ndim() != 1 || n->shape(0) != Dh) bad("q and k norm weights (Dh,) float32");
  need_rows(positions, B, "attention_block", "positions");
  need_rows(starts, B, "attention_block", "starts");
  need_f32(h, "attention_block", "h");
  need_f32(post_norm, "attention_block", "the norm weight");
  if (h.shape() != mx::Shape{(int)B, 1, (int)No} || post_norm.ndim() != 1 || post_norm.shape(0) != No)
    bad("h (B, 1, N) of the o projection's width N, the norm weight (N,)");
  auto s = mx::default_stream(mx::Device::cpu);
  // the KV pair: the keys' write (x, k..., k_norm[, positions], keys), then the values' (x, v..., values)
  std::vector<mx::array> in{x};
  in.insert(in.end(), k.begin(), k.end());
  in.push_back(k_norm);
  if (positions) in.push_back(*positions);
  in.push_back(keys);
  const size_t nk = in.size();
  in.push_back(x);
  in.insert(in.end(), v.begin(), v.end());
  in.push_back(values);
  const size_t np = in.size();
  // the add-norm running the attention: (x, q..., q_norm[, positions][, starts], <keys, values>, o...), h, post_norm
  const size_t first = in.size();
  in.push_back(x);
  in.insert(in.end(), q.begin(), q.end());
  in.push_back(q_norm);
  if (positions) in.push_back(*positions);
  if (starts) in.push_back(*starts);
  const size_t at = in.size() - first;
  in.insert(in.end(), o.begin(), o.end());
  const int attention_inputs = (int)(in.size() - first + 2);
  in.push_back(h);
  in.push_back(post_norm);
  const Rotation rk{true, (bool)positions, k_eps, dims, traditional, base, rope_scale};
  const Rotation rq{true, (bool)positions, q_eps, dims, traditional, base, rope_scale};
  auto attention = std::make_shared<DecodeAttentionOp>(s, offset, rq, (bool)starts, scale, pq, po);
  const KVPair pair{offset, nk, rk, pk, pv};
  auto op = std::make_shared<AttentionBlockOp>(s, pair, np, post_eps, Absorbed{attention, attention_inputs}, at);
  op->hold(in, {nk - 1, np - 1});  // the weights; the cache's buffers stay shown, to pass on to the outputs
  return mx::array::make_arrays(
      {h.shape(), h.shape(), keys.shape(), values.shape()}, {mx::float32, mx::float32, mx::float32, mx::float32},
      std::move(op), std::move(in));
}

static mx::array adapt_add_op(const mx::array& y, const mx::array& x, const mx::array& a, const mx::array& b,
                              float scale) {
  need_f32(y, "adapt_add", "y");
  need_f32(x, "adapt_add", "x");
  const int64_t D = x.shape(-1), N = y.shape(-1);
  if (D == 0 || N == 0 || x.size() / D != y.size() / N || !lora_fits(a, b, D, N))
    fail("adapt_add: x (R, D), y (R, N), lora_a (D, r) and lora_b (r, N), both float32 or both bfloat16");
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array(y.shape(), mx::float32, std::make_shared<AdaptAdd>(s, scale), {y, x, a, b});
}

// One new token's MoE block for each of its rows (one sequence, or a served batch) with every expert resident: the
// router's product, its softmax top-k (chosen among `among`, predicted routing's candidates, when given), the routed
// experts' SwiGLU, their weighted sum and the residual add with the RMS norm after it, as one node (MoeBlockOp) with
// the bits of the nodes SoftmaxMoeBlock, compute/qmm.py gather_glu, compute/routing.py and add_norm build one by one.
// With `table`, the experts are a slot bank (see MoeBlockOp). Returns (h + the experts' sum, its norm, the routed ids).
static std::vector<mx::array> moe_block_op(const mx::array& x, const mx::array& h, const std::vector<mx::array>& router,
                                           int router_group_size, int k, bool norm_topk,
                                           const std::optional<mx::array>& among, const std::vector<mx::array>& gate,
                                           const std::vector<mx::array>& up, const std::vector<mx::array>& down,
                                           int group_size, const mx::array& norm, float eps,
                                           const std::optional<mx::array>& lora_a,
                                           const std::optional<mx::array>& lora_b, float lora_scale,
                                           const std::optional<mx::array>& table) {
  if (router.size() != 3) fail("moe_block: the router is (w, scales, biases)");
  const int64_t T = check_x(x, router_group_size), D = x.shape(-1);
  check_x(x, group_size);
  const int64_t E = check_weights(router[0], router[1], router[2], D, router_group_size);
  if (router[0].ndim() != 2 || k < 1 || k > E) fail("moe_block: the router must be (E, D*bits/32) and 1 <= k <= E");
  if (check_glu(gate, up, down, D, group_size) != D || (!table && gate[0].shape(0) != E))
    fail("moe_block: the experts must be the router's E, their down projection back to D");
  if (table && (table->dtype() != mx::uint32 || table->ndim() != 1 || table->shape(0) != E))
    fail("moe_block: the table must be uint32 (E,): each expert's slot in the bank");
  need_f32(h, "moe_block", "h");
  need_f32(norm, "moe_block", "the norm weight");
  if (h.shape() != x.shape() || norm.ndim() != 1 || norm.shape(0) != D)
    fail("moe_block: h must be x's shape and the norm weight (D,)");
  if (among && (among->dtype() != mx::uint32 || among->shape(-1) < k || among->size() / among->shape(-1) != T))
    fail("moe_block: among must be uint32 (..., M), M >= k, a row per token");
  std::vector<mx::array> in{x, router[0], router[1], router[2]};
  for (auto* part : {&gate, &up, &down}) in.insert(in.end(), part->begin(), part->end());
  in.push_back(h);
  in.push_back(norm);
  if (among) in.push_back(*among);
  if (table) in.push_back(*table);
  if (lora_a.has_value() != lora_b.has_value()) fail("moe_block: lora_a and lora_b come together");
  if (lora_a) {
    if (!lora_fits(*lora_a, *lora_b, D, D) || lora_scale == 0.f)
      fail("moe_block: the branch must be lora_a (D, r) and lora_b (r, D), both float32 or both bfloat16, scale not 0");
    in.push_back(*lora_a);
    in.push_back(*lora_b);
  }
  mx::Shape ids(x.shape().begin(), x.shape().end());
  ids.back() = k;
  auto s = mx::default_stream(mx::Device::cpu);
  auto op = std::make_shared<MoeBlockOp>(s, router_group_size, k, norm_topk, (bool)among, (bool)table, group_size, eps,
                                         lora_a ? lora_scale : 0.f);
  op->hold(in);  // the router's, the experts' and the branch's weights
  auto out = mx::array::make_arrays({x.shape(), x.shape(), ids, ids}, {mx::float32, mx::float32, mx::uint32, mx::float32},
                                    std::move(op), std::move(in));
  return {out[0], out[1], out[2]};
}

// A (B,) int32 array of per-sequence values (rope's offsets, attention's first keys), checked.
static void need_rows(const std::optional<mx::array>& a, int64_t B, const char* op, const char* what) {
  if (a && (a->dtype() != mx::int32 || a->ndim() != 1 || a->shape(0) != B))
    throw std::invalid_argument(std::string("edge0 ") + op + ": " + what + " must be int32 of shape (B,)");
}

static mx::array rope_op(const mx::array& x, int dims, bool traditional, float base, float scale, int64_t offset,
                         const std::optional<mx::array>& offsets) {
  need_f32(x, "rope", "x");
  if (x.ndim() != 4 || dims <= 0 || dims % 2 || dims > x.shape(3))
    throw std::invalid_argument("edge0 rope: x must be (B, H, L, Dh) and dims even, at most Dh");
  need_rows(offsets, x.shape(0), "rope", "offsets");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> in{x};
  if (offsets) in.push_back(*offsets);
  return mx::array(x.shape(), mx::float32, std::make_shared<RoPEOp>(s, dims, traditional, base, scale, offset), in);
}

static mx::array attention_op(const mx::array& q, const mx::array& k, const mx::array& v, float scale, bool causal,
                              const std::optional<mx::array>& starts) {
  for (auto* a : {&q, &k, &v}) need_f32(*a, "attention", "q, k and v");
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k.shape() != v.shape() || q.shape(0) != k.shape(0) ||
      q.shape(3) != k.shape(3) || k.shape(1) == 0 || q.shape(1) % k.shape(1) || k.shape(2) == 0 ||
      q.shape(2) > k.shape(2))
    throw std::invalid_argument(
        "edge0 attention: q (B, Hq, L, Dh), k and v (B, Hkv, S, Dh), S >= L, Hq a multiple of Hkv");
  need_rows(starts, q.shape(0), "attention", "starts");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> in{q, k, v};
  if (starts) in.push_back(*starts);
  return mx::array(q.shape(), mx::float32, std::make_shared<AttentionOp>(s, scale, causal), in);
}

// Waking a sleeping thread costs tens of microseconds on a VM, on the waker's side too (a one-node round trip here:
// mx.eval 114-178 us): a third of a small layer's compute, twice a layer where each layer's routed ids go to the host
// (the stream thread sleeps while the host plans, and the graph-building thread sleeps while the stream computes).
// Between the graphs of a step the stream can be held awake instead: a Hold node, queued after the graph, spins
// (yielding its core at every turn) until the next graph is queued behind it or hold_us pass, so that queueing that
// graph wakes no one; and the host spins for the values it needs before it sleeps (host_eval).
static std::atomic<uint64_t> holds_made{0}, holds_released{0};

class HoldOp : public mx::UnaryPrimitive {
 public:
  HoldOp(mx::Stream s, uint64_t id, int64_t hold_us) : mx::UnaryPrimitive(s), id_(id), hold_us_(hold_us) {}
  void eval_cpu(const std::vector<mx::array>&, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.set_output_array(out);
    enc.dispatch([id = id_, hold_us = hold_us_, out]() mutable {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(hold_us);
      for (int i = 0; holds_released.load(std::memory_order_acquire) < id; i++) {
        if ((i & 15) == 15 && std::chrono::steady_clock::now() > until) break;
        std::this_thread::yield();
      }
      out.data<uint8_t>()[0] = 0;
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }
  const char* name() const override { return "Edge0Hold"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  uint64_t id_;
  int64_t hold_us_;
};

// async_eval(arrays), then a Hold queued behind them (its own evaluation: the arrays' event does not wait for it),
// then the Hold queued before released: the stream goes on to these arrays without sleeping between.
static void queue_held(std::vector<mx::array>& arrays, int64_t hold_us) {
  mx::async_eval(arrays);
  if (hold_us <= 0) {  // no Hold after these; the one before them released all the same
    holds_released.store(holds_made.load(std::memory_order_acquire), std::memory_order_release);
    return;
  }
  const uint64_t id = holds_made.fetch_add(1) + 1;
  mx::async_eval({mx::array({}, mx::uint8, std::make_shared<HoldOp>(mx::default_stream(mx::Device::cpu), id, hold_us),
                            {})});
  holds_released.store(id - 1, std::memory_order_release);
}

static void queue(const std::vector<mx::array>& arrays, int64_t hold_us) {
  nb::gil_scoped_release nogil;
  std::vector<mx::array> out(arrays);
  queue_held(out, hold_us);
}

// mx.eval(arrays) for values the host needs now: queued (queue_held), then the calling thread spins for them up to
// spin_us before it waits as mx.eval waits (sleeping; errors raised as there).
static void host_eval(const std::vector<mx::array>& arrays, int64_t spin_us, int64_t hold_us) {
  nb::gil_scoped_release nogil;
  std::vector<mx::array> out(arrays);
  queue_held(out, hold_us);
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  const auto ready = [&] {
    for (auto& a : out)
      if (!a.is_available()) return false;
    return true;
  };
  for (int i = 0; !ready(); i++) {
    if ((i & 15) == 15 && std::chrono::steady_clock::now() > until) break;
    std::this_thread::yield();
  }
  mx::eval(out);
}

// fn() on the thread of MLX's CPU stream, after the work queued there; returns when it has run.
static void on_stream(const std::function<void()>& fn) {
  nb::gil_scoped_release nogil;
  std::promise<void> ran;
  auto done = ran.get_future();
  mx::cpu::get_command_encoder(mx::default_stream(mx::Device::cpu)).dispatch([&] {
    fn();
    ran.set_value();
  });
  done.wait();
}

// The cores MLX's CPU stream thread may run on: `cpus` (empty: any the process may use); Linux only.
static void place_stream(const std::vector<int>& cpus) {
  on_stream([&] { set_this_thread_cpus(cpus); });
}

static std::vector<int> stream_cpus() {
  std::vector<int> out;
  on_stream([&] { out = this_thread_cpus(); });
  return out;
}

}  // namespace edge0

NB_MODULE(_kernels, m) {
  m.doc() = "Edge0's CPU kernels for MLX's affine 4-bit layout (see csrc/qmv.cpp).";
  m.def("qmv", &edge0::qmv_op, "x"_a, "w"_a, "scales"_a, "biases"_a, "idx"_a = nb::none(), "group_size"_a = 64,
        "shape"_a = nb::none(),
        "out[o] = W[idx[o]] @ x[o // (R / Rx)] for x (..., D) of Rx rows, idx of R entries, 4-bit affine W;\n"
        "R x N float32, shaped `shape` (default (R, N)); W of 4 or 8 bits (told by its packed width).");
  m.def("glu", &edge0::glu_op, "x"_a, "idx"_a, "gate"_a, "up"_a, "down"_a, "group_size"_a = 64, "shape"_a = nb::none(),
        "out[o] = down[e] @ (silu(gate[e] @ xr) * (up[e] @ xr)), e = idx[o], xr = x[o // (R / Rx)]: a routed\n"
        "expert's SwiGLU in one node; gate, up, down are (w, scales, biases) of 4-bit affine (E, ., .) weights.");
  m.def("qmv_lora", &edge0::qmv_lora_op, "x"_a, "w"_a, "scales"_a, "biases"_a, "lora_a"_a, "lora_b"_a, "scale"_a,
        "group_size"_a = 64,
        "W x + scale * (x lora_a) lora_b for a dense 4- or 8-bit affine W (N, D*bits/32), lora_a (D, r),\n"
        "lora_b (r, N) float32 or bfloat16: a quantized linear with its unmerged adapter in one node.");
  m.def("math", &edge0::math_op, "x"_a, "fn"_a, "exp or erf of x (float32) as the kernels compute them, evaluated now.");
  m.def("add_rms_norm", &edge0::add_rms_norm_op, "x"_a, "r"_a, "weight"_a, "eps"_a,
        "(h, n): h = x + r and n = rms_norm(h, weight, eps), one node (a residual add and the norm after it).");
  m.def("rms_norm", &edge0::rms_norm_op, "x"_a, "weight"_a, "eps"_a,
        "x * rsqrt(mean(x^2, -1) + eps) * weight, float32, one graph node (mx.fast.rms_norm's math).");
  m.def("linear", &edge0::linear_op, "x"_a, "weight"_a, "bias"_a = nb::none(),
        "x @ weight.T (+ bias), float32, one node; each output one fixed-order sum, so a row's result does not\n"
        "depend on the rows beside it (a batch equals its rows alone).");
  m.def("head", &edge0::head_op, "x"_a, "now"_a, "prev"_a, "router"_a, "delta"_a, "w1"_a, "b1"_a, "w2"_a, "b2"_a,
        "A prerouter head in one node: (router + delta f) + w2 gelu(w1 f + b1) + b2 for the features\n"
        "f = [x, multi-hot(now), multi-hot(prev)] (ids >= E name no expert; prev None: zeros), each product as linear.");
  m.def("embed", &edge0::embed_op, "ids"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "Rows ids of a 4- or 8-bit affine-quantized table (V, D*bits/32) with float32 scales and biases (V, D/gs):\n"
        "(*ids.shape, D) float32, each element as mx.dequantize rounds it; an id out of range gives zeros.");
  m.def("softmax_topk", &edge0::softmax_topk_op, "logits"_a, "k"_a, "norm"_a, "among"_a = nb::none(),
        "(inds, scores) of the k most probable experts under softmax(logits), scores renormalised when norm;\n"
        "among (..., M) uint32: the k most probable of each row's candidate ids only.");
  m.def("combine", &edge0::combine_op, "y"_a, "scores"_a,
        "sum over K of scores[..., K, None] * y[..., K, :]: the routed experts' weighted sum, (..., D).");
  m.def("rope", &edge0::rope_op, "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a, "offset"_a,
        "offsets"_a = nb::none(),
        "Rotary embedding of x (B, H, L, Dh) at positions offset + l, float32 (mx.fast.rope's math);\n"
        "offsets (B,) int32: sequence b at offsets[b] + l instead.");
  m.def("attention", &edge0::attention_op, "q"_a, "k"_a, "v"_a, "scale"_a, "causal"_a = false,
        "starts"_a = nb::none(),
        "softmax(scale * q k^T) v: q (B, Hq, L, Dh), k and v (B, Hkv, S, Dh); causal: query l sees keys\n"
        "up to S - L + l; starts (B,) int32: sequence b sees keys from starts[b] on (a left-padded batch).");
  m.attr("MAX_GROUPS") = edge0::MAX_GROUPS;
  m.def("kv_write", &edge0::kv_write_op, "x"_a, "norm"_a.none(), "buffer"_a, "offset"_a, "eps"_a = 0.0f,
        "dims"_a = 0, "traditional"_a = false, "base"_a = 10000.0f, "rope_scale"_a = 1.0f,
        "positions"_a = nb::none(),
        "A KV cache buffer (B, H, C, Dh) with row offset of each sequence set to its H heads in x, RMS-normed by norm "
        "(or None) and rotated over dims features (0: not rotated) at offset, or at positions[b] ((B,) int32), as one "
        "node; written in place when nothing else holds it.");
  m.def("decode_attention", &edge0::decode_attention_op, "q"_a, "norm"_a.none(), "keys"_a, "values"_a, "offset"_a,
        "eps"_a, "dims"_a, "traditional"_a, "base"_a, "rope_scale"_a, "scale"_a, "positions"_a = nb::none(),
        "starts"_a = nb::none(),
        "One new token's attention of each of B sequences as one node: q's heads RMS-normed (norm or None) and rotated "
        "at offset (or positions[b]), then attending to rows starts[b] (or 0) .. offset of the (B, Hkv, C, Dh) "
        "buffers; (B, 1, heads*Dh).");
  m.def("attention_block", &edge0::attention_block_op, "x"_a, "h"_a, "q"_a, "k"_a, "v"_a, "o"_a, "lora_scale"_a,
        "group_size"_a, "q_norm"_a, "q_eps"_a, "k_norm"_a, "k_eps"_a, "keys"_a, "values"_a, "offset"_a, "dims"_a,
        "traditional"_a, "base"_a, "rope_scale"_a, "scale"_a, "post_norm"_a, "post_eps"_a,
        "positions"_a = nb::none(), "starts"_a = nb::none(),
        "A new token (one a sequence) through an attention block: the k, v, q projections (w, scales, biases[, "
        "lora_a, lora_b]), kv_write of k and v, decode_attention, the o projection, add_rms_norm with h, as one node "
        "with the bits of the nodes those calls build. Returns [h + attention, its norm, keys, values].");
  m.def("moe_block", &edge0::moe_block_op, "x"_a, "h"_a, "router"_a, "router_group_size"_a, "k"_a, "norm_topk"_a,
        "among"_a.none(), "gate"_a, "up"_a, "down"_a, "group_size"_a, "norm"_a, "eps"_a, "lora_a"_a = nb::none(),
        "lora_b"_a = nb::none(), "lora_scale"_a = 0.f, "table"_a = nb::none(),
        "A new token (one a row) through an MoE block of resident experts: qmv of the router, softmax_topk (among "
        "the candidates when given), glu, combine, adapt_add of the adapter's branch when given, add_rms_norm with "
        "h, as one node with the bits of the nodes those calls build. With table (E,) uint32 the experts are a slot "
        "bank and table[id] the slot of expert id. Returns [h + the experts' sum, its norm, the routed ids].");
  m.def("adapt_add", &edge0::adapt_add_op, "y"_a, "x"_a, "lora_a"_a, "lora_b"_a, "scale"_a,
        "y + scale * (x lora_a) lora_b: an adapter's branch beside a block whose output is y, with the bits qmv_lora "
        "adds its branch with.");
  m.def("log_softmax", &edge0::log_softmax_op, "x"_a,
        "x - logsumexp(x) over the last axis as one node, the bits of MLX's x - mx.logsumexp(x, axis=-1, keepdims=True) "
        "(float32).");
  m.def("step_log_softmax", &edge0::step_log_softmax_op, "x"_a,
        "A decode step's log-probabilities from its logits x (B, 1, V): [(B, V), the first row as (V,)], one node "
        "with log_softmax's bits (running the LM head's product when x is that node, not yet evaluated).");
  m.def("kv_copies", [] { return edge0::kv_copies.load(); },
        "How many times kv_write copied a cache buffer (it was held elsewhere) instead of writing it in place.");
  m.def("place_threads",
        [](const std::vector<int>& stream, const std::vector<int>& workers) {
          edge0::place_stream(stream);
          edge0::place_workers(workers);
        },
        "stream"_a, "workers"_a,
        "The cores MLX's CPU stream thread and the kernels' pool workers may run on (empty: any); Linux only.");
  m.def("thread_cpus", [] { return std::make_pair(edge0::stream_cpus(), edge0::worker_cpus()); },
        "(the cores the stream thread may run on, those of the first pool worker: empty where there is none).");
  m.def("set_holding", [](bool on) { edge0::holding.store(on); }, "on"_a,
        "Whether the nodes built from now on keep their evaluated inputs (a layer's weights) themselves rather than\n"
        "list them for MLX to walk at every eval (default on; the same bits either way).");
  m.def("host_eval", &edge0::host_eval, "arrays"_a, "spin_us"_a, "hold_us"_a = 0,
        "mx.eval(arrays), the caller spinning for them up to spin_us before it sleeps (a sync on the critical path);\n"
        "hold_us > 0: the stream then held awake up to hold_us for the next graph (queue, host_eval); 0: the hold\n"
        "queued before released, none after.");
  m.def("queue", &edge0::queue, "arrays"_a, "hold_us"_a,
        "mx.async_eval(arrays), the stream then held awake up to hold_us for the next graph (a Hold node).");
  nb::class_<edge0::PackReservation>(m, "PackReservation",
                                     "A zero packed copy being made ahead of a new slot bank (reserve_pack).")
      .def("address", &edge0::PackReservation::address,
           "The address of the copy's words, once made (0: taken by a bank's pack already).");
  m.def("reserve_pack", &edge0::reserve_pack, "experts"_a, "outputs"_a, "inputs"_a, "group_size"_a, "bf16"_a,
        "Start making, on a thread of its own, the zero packed copy that pack(zeros=True, reserved=...) of a new bank\n"
        "of `experts` 4-bit (outputs, inputs) weights will take (scales as bfloat16 or float32); None where the\n"
        "layout does not apply.");
  m.def("pack", &edge0::pack_weights, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "zeros"_a = false,
        "reserved"_a = nb::none(),
        "Keep a packed copy of these 4-bit weights (which must never change, or change only through repack) for the\n"
        "products that read them: 16 outputs a vector, the same bits. False where the layout does not apply (they keep\n"
        "the row layout). zeros: the arrays are all zeros (a new slot bank): the copy is made zeroed, without reading them,\n"
        "or taken from `reserved` (reserve_pack) where its shape is theirs.");
  m.def("repack", &edge0::repack_weights, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "slots"_a,
        "The experts `slots` of packed weights were written again (a bank's fills): their packed copy follows. Only\n"
        "while no product reads those experts. False where the weights have no packed copy.");
  m.def("packed", &edge0::is_packed, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "Whether products of these 4-bit weights run on a packed copy.");
  m.def("packed_address", &edge0::packed_address, "w"_a, "scales"_a, "biases"_a, "group_size"_a,
        "The address of the packed copy's words of these weights (0: none).");
  m.def("set_packed", &edge0::set_packed, "on"_a,
        "Whether products run on packed copies where weights have one (default True); off: the row layout, the same\n"
        "bits.");
  m.def("packed_on", &edge0::packed_on);
  m.def("ready", [](const std::vector<mx::array>& arrays) {
          for (auto& a : arrays)
            if (!a.is_available()) return false;
          return true;
        }, "arrays"_a, "Whether every array's value is ready to read now (no wait, no evaluation).");
  m.def("mlx_version", [] { return std::string(EDGE0_STR(EDGE0_MLX_VERSION)); },
        "The MLX version this extension was built against.");
  m.def("impl", [] { return std::string(edge0::impl()); }, "avx512, avx2 or portable: the path qmv takes.");
  m.def("set_impl", [](const std::string& n) { return edge0::set_impl(n.c_str()); }, "name"_a);
  m.def("impls", &edge0::impls, "qmv's code paths built here, narrowest first.");
  m.def("dense_impl", [] { return std::string(edge0::dense_impl()); },
        "avx512, avx2 or portable: the build of the dense ops (norms, rope, attention, float linears) in use.");
  m.def("set_dense_impl", [](const std::string& n) { return edge0::set_dense_impl(n.c_str()); }, "name"_a);
  m.def("dense_impls", &edge0::dense_impls, "the dense ops' builds, narrowest first.");
  m.def("set_num_threads", &edge0::set_num_threads, "n"_a, "prompt"_a = 0,
        "Compute threads, the caller included: n for decode steps, prompt (n when 0) for prompt chunks\n"
        "(nodes of at least SPREAD_ROWS token rows: prompt chunks, a served batch's steps).");
  m.def("num_threads", &edge0::num_threads);
  m.def("set_profile", [](bool on) { edge0::profiling.store(on); }, "on"_a,
        "Time every edge0 node from now on (on) or no more; see profile().");
  m.def(
      "profile",
      [](bool reset) {
        std::lock_guard<std::mutex> lk(edge0::profile_mu);
        auto out = edge0::profile_;
        if (reset) edge0::profile_.clear();
        return out;
      },
      "reset"_a = true, "{node name and widths: (nodes, seconds)} timed since the last reset.");
  m.def("prompt_threads", &edge0::prompt_threads);
  m.attr("PROMPT_ROWS") = edge0::PROMPT_ROWS;
  m.attr("SPREAD_ROWS") = edge0::SPREAD_ROWS;
}
