// MLX's CPU stream thread (stream.h).
#include "stream.h"

#include <nanobind/nanobind.h>  // the GIL is let go while the caller waits for the stream

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <thread>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "qmv.h"

namespace nb = nanobind;

namespace edge0 {

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

void queue(const std::vector<mx::array>& arrays, int64_t hold_us) {
  nb::gil_scoped_release nogil;
  std::vector<mx::array> out(arrays);
  queue_held(out, hold_us);
}

// mx.eval(arrays) for values the host needs now: queued (queue_held), then the calling thread spins for them up to
// spin_us before it waits as mx.eval waits (sleeping; errors raised as there).
void host_eval(const std::vector<mx::array>& arrays, int64_t spin_us, int64_t hold_us) {
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
void place_stream(const std::vector<int>& cpus) {
  on_stream([&] { set_this_thread_cpus(cpus); });
}

std::vector<int> stream_cpus() {
  std::vector<int> out;
  on_stream([&] { out = this_thread_cpus(); });
  return out;
}

}  // namespace edge0
