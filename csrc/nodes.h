// What every edge0 graph node shares: reading MLX's arrays (views included), the inputs a node keeps itself
// (Held), a node running the node of its input inside it (Computes, Absorbed, Projection), and the base classes of
// the one-output (DenseOp) and several-output (MultiOp) nodes. The kernels themselves are in qmv.h and dense.h.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "dense.h"
#include "profile.h"

namespace mx = mlx::core;

namespace edge0 {

// Inputs are taken as MLX hands them to eval_cpu, views included: no Contiguous node is added to the
// graph (a node costs microseconds of dispatch, more than these copies); a strided input is copied here.
// The copy goes by runs: the trailing axes that are contiguous in the view (a KV cache trimmed at its front, a
// batch's rows taken) are one memcpy each, the outer axes an odometer; a view with no contiguous axis (a
// transpose, a broadcast) copies element by element. A served batch copies its KV caches when sequences join or
// leave: element by element that was 16% of the server's CPU under load (perf on `edge0 serve --max-batch 8`).
template <typename T>
const T* dense_data(const mx::array& a, std::vector<T>& tmp) {
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

inline View4 view4(const mx::array& a) {
  View4 v{a.data<float>(), {}, {}};
  for (int d = 0; d < 4; d++) {
    v.shape[d] = a.shape(d);
    v.strides[d] = a.strides()[d];
  }
  return v;
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

// The inputs a node keeps itself rather than list for MLX: arrays already evaluated when the node is built (a layer's
// weights, above all). MLX needs a node's inputs to order its work; an evaluated array orders nothing, yet every eval
// walks it (a hash-map entry and a stack push on the graph-building thread, a buffer-set entry, a copy in the list of
// each of the node's outputs): on the built-in model about 250 of a decode step's 300 inputs. The node's function
// still sees its whole input list, in its order (all()).
class Held {
 public:
  // Moves the evaluated arrays of `in` into this, but those at `shown` (buffers the node passes on, which MLX must
  // see to let it), leaving in `in` the arrays MLX sees, in their order.
  void take(std::vector<mx::array>& in, std::initializer_list<size_t> shown = {}) {
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
inline std::vector<mx::array> whole_inputs(const mx::array& a) {
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
inline Absorbed absorbable_node(const mx::array& a) {
  if (a.status() != mx::array::Status::unscheduled || !a.siblings().empty() ||
      dynamic_cast<Computes*>(&a.primitive()) == nullptr)
    return {};
  return {a.primitive_ptr(), (int)whole_inputs(a).size()};
}

// the inputs of a node taking `a` first: a's node's inputs where it runs inside, else a
inline std::vector<mx::array> leading(const mx::array& a, const Absorbed& p) {
  return p.from ? whole_inputs(a) : std::vector<mx::array>{a};
}

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

inline void need_f32(const mx::array& a, const char* op, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string("edge0 ") + op + ": " + what + " must be float32");
}

// a node of op over `in`, keeping the evaluated arrays of `in` itself (Holder)
template <typename Op>
mx::array held_node(const mx::Shape& shape, mx::Dtype dtype, std::shared_ptr<Op> op, std::vector<mx::array> in) {
  op->hold(in);
  return mx::array(shape, dtype, std::move(op), std::move(in));
}

template <typename Op>
std::vector<mx::array> held_nodes(std::vector<mx::Shape> shapes, std::vector<mx::Dtype> dtypes,
                                         std::shared_ptr<Op> op, std::vector<mx::array> in) {
  op->hold(in);
  return mx::array::make_arrays(std::move(shapes), std::move(dtypes), std::move(op), std::move(in));
}

// A (B,) int32 array of per-sequence values (rope's offsets, attention's first keys), checked.
inline void need_rows(const std::optional<mx::array>& a, int64_t B, const char* op, const char* what) {
  if (a && (a->dtype() != mx::int32 || a->ndim() != 1 || a->shape(0) != B))
    throw std::invalid_argument(std::string("edge0 ") + op + ": " + what + " must be int32 of shape (B,)");
}

}  // namespace edge0
