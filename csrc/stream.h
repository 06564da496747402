// MLX's CPU stream thread: where it runs (its cores, beside the kernels' pool workers of qmv.h), and keeping it awake
// between the graphs of a step (queue, host_eval) instead of letting it sleep.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace mx = mlx::core;

namespace edge0 {

// mx.async_eval(arrays), the stream then held awake up to hold_us for the next graph (a Hold node).
void queue(const std::vector<mx::array>& arrays, int64_t hold_us);
// mx.eval(arrays) for values the host needs now, the caller spinning for them up to spin_us before it sleeps; the
// stream then held up to hold_us (0: none after).
void host_eval(const std::vector<mx::array>& arrays, int64_t spin_us, int64_t hold_us);
// The cores MLX's CPU stream thread may run on: `cpus` (empty: any the process may use); Linux only.
void place_stream(const std::vector<int>& cpus);
// The cores the stream thread may run on now.
std::vector<int> stream_cpus();

}  // namespace edge0
