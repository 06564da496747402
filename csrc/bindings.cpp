// The Python module of Edge0's CPU kernels (nanobind, MLX's domain so that functions take mx.array directly): the
// bindings only. The functions bound build graph nodes (qmv_nodes, dense_nodes, attention_nodes, moe_nodes), whose
// eval_cpu runs the kernels (qmv.cpp, dense.cpp) on MLX's CPU stream thread.

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/version.h"
#include "attention_nodes.h"
#include "dense.h"
#include "dense_nodes.h"
#include "moe_nodes.h"
#include "nodes.h"
#include "pack_cache.h"
#include "profile.h"
#include "qmv.h"
#include "qmv_nodes.h"
#include "stream.h"

namespace nb = nanobind;
using namespace nb::literals;

#define EDGE0_STR2(x) #x
#define EDGE0_STR(x) EDGE0_STR2(x)

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
  m.def("kv_copies", &edge0::kv_copies,
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
  // a test hook: the tests run the same weights on both layouts and compare their bits
  m.def("set_packed", &edge0::set_packed, "on"_a,
        "Whether products run on packed copies where weights have one (default True); off: the row layout, the same\n"
        "bits (for the tests that compare the two).");
  m.def("packed_on", &edge0::packed_on, "Whether products run on packed copies (set_packed).");
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
  // the tests read from the profile which kinds of node ran (equal outputs cannot show which path ran)
  m.def("set_profile", [](bool on) { edge0::profiling.store(on); }, "on"_a,
        "Time every edge0 node from now on (on) or no more; see profile().");
  m.def("profile", &edge0::profile, "reset"_a = true,
        "{node name and widths: (nodes, seconds)} timed since the last reset.");
  m.def("prompt_threads", &edge0::prompt_threads);
  m.attr("PROMPT_ROWS") = edge0::PROMPT_ROWS;
  m.attr("SPREAD_ROWS") = edge0::SPREAD_ROWS;
}

