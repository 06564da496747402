// MLX primitives over the kernels of qmv.cpp, and their Python bindings (nanobind, MLX's domain so
// that functions take mx.array directly). The functions here only build graph nodes; eval_cpu runs
// the kernel on MLX's CPU stream thread.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <sstream>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/version.h"
#include "qmv.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

#define EDGE0_STR2(x) #x
#define EDGE0_STR(x) EDGE0_STR2(x)

namespace edge0 {

// Output row o reads x row o / ratio (ratio = rows per x row) and expert idx[o] (or 0 without idx).
class QMV : public mx::UnaryPrimitive {
 public:
  QMV(mx::Stream stream, int group_size, int64_t ratio, bool has_idx)
      : mx::UnaryPrimitive(stream), group_size_(group_size), ratio_(ratio), has_idx_(has_idx) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, gs = group_size_, ratio = ratio_, has_idx = has_idx_]() mutable {
      const auto& x = inputs[0];
      const auto& w = inputs[1];
      const int64_t D = x.shape(-1), N = w.shape(-2);
      const int64_t E = w.ndim() == 3 ? w.shape(0) : 1;
      const int64_t R = out.shape(0);
      QWeights q{w.data<uint8_t>(), inputs[2].data<float>(), inputs[3].data<float>(), E, N, D, gs};
      std::vector<Pair> pairs(R);
      const uint32_t* idx = has_idx ? inputs[4].data<uint32_t>() : nullptr;
      for (int64_t o = 0; o < R; o++) pairs[o] = {idx ? (int64_t)idx[o] : 0, o / ratio, o};
      qmv(q, x.data<float>(), x.shape(0), pairs, out.data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("edge0 kernels: CPU only");
  }

  const char* name() const override { return "Edge0QMV"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const QMV&>(other);
    return group_size_ == o.group_size_ && ratio_ == o.ratio_ && has_idx_ == o.has_idx_;
  }

 private:
  int group_size_;
  int64_t ratio_;
  bool has_idx_;
};

// x (Rx, D) float32; w (E, N, D/8) or (N, D/8) uint32; scales, biases (..., N, D/gs) float32;
// idx (R,) expert per output row, or none (R = Rx, expert 0). -> (R, N) float32.
static mx::array qmv_op(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                        std::optional<mx::array> idx, int group_size) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("edge0 qmv: " + m); };
  if (x.ndim() != 2 || x.dtype() != mx::float32) fail("x must be (rows, D) float32");
  if ((w.ndim() != 2 && w.ndim() != 3) || w.dtype() != mx::uint32) fail("w must be (E, N, D/8) uint32");
  if (scales.dtype() != mx::float32 || biases.dtype() != mx::float32) fail("scales and biases must be float32");
  if (group_size != 32 && group_size != 64 && group_size != 128) fail("group_size must be 32, 64 or 128");
  const int64_t D = x.shape(1), N = w.shape(-2), G = D / group_size;
  if (D % 64 != 0 || w.shape(-1) * 8 != D) fail("D must be a multiple of 64 matching w");
  if (G > 4096) fail("too many groups");
  if (scales.shape() != biases.shape() || scales.shape(-1) != G || scales.shape(-2) != N ||
      scales.ndim() != w.ndim() || (w.ndim() == 3 && scales.shape(0) != w.shape(0)))
    fail("scales/biases shape does not match w");
  const int64_t rx = x.shape(0);
  const int64_t R = idx ? idx->size() : rx;
  if (rx == 0 || R % rx != 0) fail("index rows must be a multiple of x rows");
  auto s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::contiguous(x, false, s), mx::contiguous(w, false, s),
                                   mx::contiguous(scales, false, s), mx::contiguous(biases, false, s)};
  if (idx) inputs.push_back(mx::contiguous(mx::astype(mx::flatten(*idx, s), mx::uint32, s), false, s));
  return mx::array({(int)R, (int)N}, mx::float32, std::make_shared<QMV>(s, group_size, R / rx, (bool)idx),
                   std::move(inputs));
}

}  // namespace edge0

NB_MODULE(_kernels, m) {
  m.doc() = "Edge0's CPU kernels for MLX's affine 4-bit layout (see csrc/qmv.cpp).";
  m.def("qmv", &edge0::qmv_op, "x"_a, "w"_a, "scales"_a, "biases"_a, "idx"_a = nb::none(), "group_size"_a = 64,
        "out[o] = W[idx[o]] @ x[o // (R / Rx)] for x (Rx, D), idx (R,), 4-bit affine W; (R, N) float32.");
  m.def("mlx_version", [] { return std::string(EDGE0_STR(EDGE0_MLX_VERSION)); },
        "The MLX version this extension was built against.");
  m.def("impl", [] { return std::string(edge0::impl()); }, "avx2 or portable: the path qmv takes.");
  m.def("set_impl", [](const std::string& n) { return edge0::set_impl(n.c_str()); }, "name"_a);
  m.def("set_num_threads", &edge0::set_num_threads, "n"_a, "Compute threads, the caller included.");
  m.def("num_threads", &edge0::num_threads);
}
