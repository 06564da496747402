"""Routing traces: what every MoE layer routed to, per token (`--record-routes FILE`, `--routes FILE`).

    trace = read_trace("olmoe-1b-7b-seed1.json")   # trace.ids (L, T, K), trace.weights (L, T, K) or None
    check_fits(trace, "--routes t.json", layers=16, experts=64, top_k=8, tokens=120)
    write_trace("run.npz", trace)                    # NPZ by suffix, else JSON

Layouts read (docs/USAGE.md "Routing traces"): Edge0's JSON (the public `expert_trace` layout plus its own
fields), Edge0's NPZ, `{"expert_trace": {"<layer>": [[ids] per token]}}` and JSON lines
`{"layer", "token", "experts"}`. Layers are matched to a model's MoE layers in order of their numbers.
Shapes: L MoE layers, T tokens, K routed.
"""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import Edge0Error, NotATrace
from ..log import log
from .atomic import atomic_path, write_atomic

FORMAT = "edge0-routes"  # the "format" field of Edge0's own traces
VERSION = 1
MAX_ID = 2**31 - 1  # ids are kept as int32
LAYOUTS = ('Edge0\'s JSON or NPZ, {"expert_trace": {"<layer>": [[ids] per token]}}, or JSON lines '
           '{"layer", "token", "experts"}')


@dataclass
class RouteTrace:
    ids: np.ndarray  # (L, T, K) int32: the experts each MoE layer routed each token to, in the router's order
    weights: np.ndarray | None  # (L, T, K) float32: their weights as the block combined them; None: not recorded
    layers: list[int]  # the number of each MoE layer (a decoder layer, as the trace names it)
    num_experts: int | None = None  # E of the model it was recorded on; None: the file does not say
    prompt_tokens: int | None = None  # rows [0, P) are the prompt's tokens, the rest decode steps; None: not said
    tokens: list[int] | None = None  # the token id at each row, where the file holds them

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[1]


def read_trace(path: str | Path, what: str | None = None) -> RouteTrace:
    """Any layout above, checked; trailing rows of padding (ids < 0) are dropped, said once. `what` names the file
    in errors (default its path)."""
    path = Path(path)
    what = what or str(path)
    if not path.is_file():
        why = 'a directory, not a file' if path.is_dir() else 'not a regular file' if path.exists() else 'no such file'
        raise Edge0Error(f"{what}: {why}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Edge0Error(f"{what}: cannot read ({e.strerror or e})") from None
    try:
        if data[:4] == b"PK\x03\x04":
            trace = _from_npz(data)
        else:
            trace = _from_text(data)
        return _checked(trace, what)
    except NotATrace as e:
        raise Edge0Error(f"{what}: not a routing trace ({e}); expected {LAYOUTS}") from None


def write_trace(path: str | Path, trace: RouteTrace) -> None:
    """Edge0's NPZ where `path` ends in .npz (compressed, about 1 byte an id), else Edge0's JSON; atomically."""
    path = Path(path)
    meta = {"format": FORMAT, "version": VERSION, "num_layers": len(trace.layers), "num_experts": trace.num_experts,
            "top_k": trace.top_k, "num_tokens": trace.num_tokens, "prompt_tokens": trace.prompt_tokens}
    if path.suffix == ".npz":
        arrays = {"ids": trace.ids.astype(np.uint8 if trace.ids.max(initial=0) < 256 else np.int32),
                  "layers": np.asarray(trace.layers, np.int32), "meta": np.array(json.dumps(meta))}
        if trace.weights is not None:
            arrays["weights"] = trace.weights.astype(np.float32)
        if trace.tokens is not None:
            arrays["tokens"] = np.asarray(trace.tokens, np.int64)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        return
    doc = {**meta, "layers": trace.layers, "tokens": trace.tokens,
           "expert_trace": {str(n): trace.ids[i].tolist() for i, n in enumerate(trace.layers)}}
    if trace.weights is not None:  # float32 values as Python floats: they read back bit for bit
        doc["weights"] = {str(n): trace.weights[i].tolist() for i, n in enumerate(trace.layers)}
    write_atomic(path, json.dumps(doc, separators=(",", ":")).encode())


def check_fits(trace: RouteTrace, what: str, *, layers: int, experts: int, top_k: int, tokens: int) -> None:
    """Refuse, naming `what`, a trace whose shape is not the run's: its MoE layers, experts and K, and at least
    `tokens` rows (the tokens the run computes)."""
    if len(trace.layers) != layers:
        raise Edge0Error(f"{what}: the trace routes {len(trace.layers)} MoE layers, the model has {layers}")
    if trace.num_experts is not None and trace.num_experts != experts:
        raise Edge0Error(f"{what}: the trace's model has {trace.num_experts} experts a layer, this one {experts}")
    top = int(trace.ids.max(initial=-1))
    if top >= experts:
        raise Edge0Error(f"{what}: the trace routes to expert {top}, the model has {experts} experts a layer")
    if trace.top_k != top_k:
        raise Edge0Error(f"{what}: the trace routes {trace.top_k} experts a token, this run {top_k} (--k)")
    if trace.num_tokens < tokens:
        raise Edge0Error(f"{what}: the trace holds {trace.num_tokens} tokens, shorter than the run's {tokens} "
                         f"(the prompt's tokens and max tokens - 1)")


def _from_text(data: bytes) -> RouteTrace:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotATrace(f"not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return _from_lines(text)
    except RecursionError:
        raise NotATrace("JSON nested too deep") from None
    if isinstance(doc, dict) and "expert_trace" in doc:
        return _from_doc(doc)
    if isinstance(doc, dict) and {"layer", "token", "experts"} & set(doc):  # JSON lines of one line
        return _from_lines(text)
    raise NotATrace("JSON without an expert_trace")


def _from_doc(doc: dict) -> RouteTrace:
    """The expert_trace layout (Edge0's JSON is it with more fields)."""
    if doc.get("format", FORMAT) != FORMAT or doc.get("version", VERSION) != VERSION:
        raise NotATrace(f"format {doc.get('format')!r} version {doc.get('version')!r}; Edge0 reads {FORMAT} {VERSION}")
    per_layer, weights = doc["expert_trace"], doc.get("weights")
    if not isinstance(per_layer, dict) or not per_layer:
        raise NotATrace("expert_trace is not an object of layers")
    names = sorted(per_layer, key=lambda n: _number(n, "expert_trace's layer"))
    ids = _stacked([_rows(per_layer[n], f"expert_trace[{n!r}]", np.int64) for n in names], names)
    w = None
    if weights is not None:
        if not isinstance(weights, dict) or sorted(weights, key=str) != sorted(names, key=str):
            raise NotATrace("weights does not name the layers expert_trace does")
        w = _stacked([_rows(weights[n], f"weights[{n!r}]", np.float64) for n in names], names)
        if w.shape != ids.shape:
            raise NotATrace(f"weights of shape {w.shape}, not the ids' {ids.shape}")
    k = doc.get("top_k")
    if k is not None and k != ids.shape[2]:
        raise NotATrace(f"top_k {k!r} but rows of {ids.shape[2]} experts")
    return RouteTrace(ids, w, [_number(n, "layer") for n in names], _opt_int(doc, "num_experts"),
                      _opt_int(doc, "prompt_tokens"), _opt_ids(doc.get("tokens")))


def _from_lines(text: str) -> RouteTrace:
    """JSON lines {"layer": l, "token": t, "experts": [ids], "weights": [w] (optional)}, in any order."""
    rows: dict[int, dict[int, tuple]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise NotATrace(f"line {n} is not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not {"layer", "token", "experts"} <= set(rec):
            raise NotATrace(f"line {n} is not an object with layer, token and experts")
        layer, token = _number(rec["layer"], f"line {n}'s layer"), _number(rec["token"], f"line {n}'s token")
        if token in rows.setdefault(layer, {}):
            raise NotATrace(f"line {n} routes layer {layer} token {token} a second time")
        rows[layer][token] = (rec["experts"], rec.get("weights"))
    if not rows:
        raise NotATrace("no routing in it")
    layers = sorted(rows)
    for layer in layers:
        if max(rows[layer]) >= len(rows[layer]):  # tokens 0..n-1 each once: the first gap (bounded by the lines)
            raise NotATrace(f"layer {layer} lacks token {min(set(range(len(rows[layer]))) - set(rows[layer]))}")
    ids = _stacked([_rows([rows[la][t][0] for t in range(len(rows[la]))], f"layer {la}", np.int64)
                    for la in layers], layers)
    weighed = {rows[la][t][1] is not None for la in layers for t in rows[la]}
    if weighed == {True, False}:
        raise NotATrace("weights on some lines only")
    w = None
    if weighed == {True}:
        w = _stacked([_rows([rows[la][t][1] for t in range(len(rows[la]))], f"layer {la}'s weights", np.float64)
                      for la in layers], layers)
        if w.shape != ids.shape:
            raise NotATrace(f"weights of shape {w.shape}, not the ids' {ids.shape}")
    return RouteTrace(ids, w, layers)


def _from_npz(data: bytes) -> RouteTrace:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError, zlib.error, MemoryError) as e:
        raise NotATrace(f"an unreadable NPZ ({e})") from None
    if not {"ids", "layers", "meta"} <= set(arrays):
        raise NotATrace(f"an NPZ without ids, layers and meta (it holds {', '.join(sorted(arrays)) or 'nothing'})")
    try:
        meta = json.loads(str(arrays["meta"]))
    except json.JSONDecodeError:
        raise NotATrace("meta is not JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise NotATrace(f"meta does not say format {FORMAT} version {VERSION}")
    ids, w, layers = arrays["ids"], arrays.get("weights"), arrays["layers"]
    if (ids.ndim != 3 or ids.dtype.kind not in "iu" or layers.shape != (ids.shape[0],) or layers.dtype.kind not in "iu"
            or (layers < 0).any()):
        raise NotATrace(f"ids of shape {ids.shape} ({ids.dtype}) with {layers.shape} layers; "
                        "expected (L, T, K) integers")
    if w is not None and (w.shape != ids.shape or w.dtype.kind != "f"):
        raise NotATrace(f"weights of shape {w.shape} ({w.dtype}), not the ids' {ids.shape} floats")
    if ids.size and ids.max() > MAX_ID:
        raise NotATrace(f"an id of {ids.max()}, too large for an expert")
    tokens = arrays.get("tokens")
    if tokens is not None and (tokens.ndim != 1 or tokens.dtype.kind not in "iu"):
        raise NotATrace(f"tokens of shape {tokens.shape} ({tokens.dtype}), not a list of integers")
    return RouteTrace(ids.astype(np.int64), w, [int(n) for n in layers], _opt_int(meta, "num_experts"),
                      _opt_int(meta, "prompt_tokens"), None if tokens is None else [int(t) for t in tokens])


def _checked(t: RouteTrace, what: str) -> RouteTrace:
    """Trailing padding dropped (said once); ids in range, distinct in a row; weights finite; int32 / float32."""
    pad = (t.ids < 0).any(axis=(0, 2))  # (T,)
    keep = len(pad) - int(np.argmin(pad[::-1])) if not pad.all() else 0
    if keep < len(pad):
        log.warning(f"{what}: {len(pad) - keep} trailing padding row(s) (ids < 0) dropped")
        t.ids = t.ids[:, :keep]
        t.weights = None if t.weights is None else t.weights[:, :keep]
    if t.ids.shape[1] == 0 or t.ids.shape[2] == 0:
        raise NotATrace("no token routed")
    if (t.ids < 0).any():
        layer, token, _ = np.argwhere(t.ids < 0)[0]
        raise NotATrace(f"layer {t.layers[layer]} token {token} has a negative id before the trailing padding")
    if t.ids.max() > MAX_ID:
        raise NotATrace(f"an id of {t.ids.max()}, too large for an expert")
    if t.num_experts is not None and t.ids.max() >= t.num_experts:
        raise NotATrace(f"an id of {t.ids.max()} with num_experts {t.num_experts}")
    srt = np.sort(t.ids, axis=2)
    if (srt[..., 1:] == srt[..., :-1]).any():
        layer, token, _ = np.argwhere(srt[..., 1:] == srt[..., :-1])[0]
        raise NotATrace(f"layer {t.layers[layer]} token {token} names an expert twice")
    if t.weights is not None and not np.isfinite(t.weights).all():
        raise NotATrace("a weight that is not a finite number")
    if t.prompt_tokens is not None and not 0 <= t.prompt_tokens <= t.ids.shape[1]:
        raise NotATrace(f"prompt_tokens {t.prompt_tokens} outside its {t.ids.shape[1]} tokens")
    if len(set(t.layers)) != len(t.layers):
        raise NotATrace("a layer named twice")
    t.ids = t.ids.astype(np.int32)
    t.weights = None if t.weights is None else t.weights.astype(np.float32)
    return t


def _rows(rows, what: str, dtype) -> np.ndarray:
    """(T, K) of a list of equal-length lists of numbers (ints where dtype is an integer type)."""
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise NotATrace(f"{what} is not a list of rows")
    lengths = {len(r) for r in rows}
    if len(lengths) > 1:
        raise NotATrace(f"{what} has rows of {min(lengths)} and of {max(lengths)} entries")
    ints = np.issubdtype(dtype, np.integer)
    ok = (lambda v: type(v) is int and abs(v) <= MAX_ID) if ints else (lambda v: type(v) in (int, float) and
                                                                       abs(v) < 1e300)
    if not all(ok(v) for r in rows for v in r):
        raise NotATrace(f"{what} holds an entry that is not {'an expert id' if ints else 'a finite number'}")
    return np.array(rows, dtype=dtype).reshape(len(rows), lengths.pop() if lengths else 0)


def _stacked(per_layer: list[np.ndarray], names: list) -> np.ndarray:
    """(L, T, K) of each layer's (T, K), which must agree."""
    first = per_layer[0].shape
    for n, a in zip(names, per_layer):
        if a.shape != first:
            raise NotATrace(f"layer {names[0]} has {first[0]} tokens of {first[1]}, "
                            f"layer {n} {a.shape[0]} of {a.shape[1]}")
    return np.stack(per_layer)


def _number(v, what: str) -> int:
    """A layer or token number: an int, or a string of one (JSON object keys)."""
    if type(v) is int and v >= 0:
        return v
    if isinstance(v, str) and v.isdigit():
        return int(v)
    raise NotATrace(f"{what} {v!r} is not a number")


def _opt_int(doc: dict, key: str) -> int | None:
    v = doc.get(key)
    if v is not None and (type(v) is not int or v < 0):
        raise NotATrace(f"{key} {v!r} is not a non-negative integer")
    return v


def _opt_ids(v) -> list[int] | None:
    if v is not None and (not isinstance(v, list) or not all(type(t) is int and t >= 0 for t in v)):
        raise NotATrace("tokens is not a list of token ids")
    return v
