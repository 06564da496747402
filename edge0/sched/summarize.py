"""`edge0 trace summarize FILE [--plot PNG]`: the breakdown of a timeline and the load-cost fit.

    edge0 run --routing prefetch --trace traces/run.json --max-tokens 32
    edge0 trace summarize traces/run.json --plot traces/run.png
    edge0 trace summarize traces/run.json --windows 32   # the same figures per 32 decode steps

Fits load cost (ms) = a + b x cold fraction by least squares, the form the paper found
(1.17 ms + 1.33 ms x cold on its machine), and prints the residuals.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..errors import Edge0Error
from ..io.atomic import atomic_path, write_error
from ..io.outputs import Kind, check_file_out, refuse_inputs, starts_with
from .trace import FORMAT

PLOT_FORMATS = {".png": (b"\x89PNG",), ".svg": (b"<?xml", b"<svg"), ".pdf": (b"%PDF",)}  # what savefig begins with


def load_trace(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise Edge0Error(f"{path}: no such trace file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Edge0Error(f"{path}: not a trace (invalid JSON: {e})") from None
    except RecursionError:
        raise Edge0Error(f"{path}: not a trace (JSON nested too deep)") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise Edge0Error(f"{path}: not a Chrome trace-event file (no traceEvents list)")
    if data.get("otherData", {}).get("format") != FORMAT:
        raise Edge0Error(f"{path}: not an Edge0 trace (expected otherData.format '{FORMAT}'; written by `edge0 run --trace`)")
    for e in data["traceEvents"]:
        if not isinstance(e, dict) or "ph" not in e or (e["ph"] == "X" and not {"ts", "dur", "name"} <= e.keys()):
            raise Edge0Error(f"{path}: damaged event {str(e)[:80]}")
        if not isinstance(e.setdefault("args", {}), dict):  # optional in the format: none is no arguments
            raise Edge0Error(f"{path}: damaged event {str(e)[:80]} (args is not an object)")
        for key in ("step", "layer"):  # numbers the summary compares and groups by
            if key in e["args"] and (type(e["args"][key]) is not int):
                raise Edge0Error(f"{path}: damaged event {str(e)[:80]} (args.{key} is not an integer)")
    return data


def fit_load_cost(ms: np.ndarray, cold: np.ndarray) -> dict:
    """Least squares ms = a + b * cold; with one distinct cold value only a is fitted."""
    if len(ms) == 0:
        return {"a_ms": None, "b_ms": None, "rms_residual_ms": None, "max_residual_ms": None}
    if np.ptp(cold) < 1e-9:
        a, b = float(ms.mean()), 0.0
    else:
        (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(cold), cold], axis=1), ms, rcond=None)
    resid = ms - (a + b * cold)
    return {"a_ms": float(a), "b_ms": float(b), "rms_residual_ms": float(np.sqrt((resid**2).mean())),
            "max_residual_ms": float(np.abs(resid).max())}


def _step_of(e: dict, starts: np.ndarray) -> int:
    """The index of the last step (by its start, `starts`) begun when event `e` begins; -1 before the first."""
    return int(np.searchsorted(starts, e["ts"], side="right")) - 1


def _within(e: dict, starts: np.ndarray, ends: np.ndarray) -> bool:
    i = _step_of(e, starts)
    return i >= 0 and e["ts"] <= ends[i]


def summarize(data: dict) -> dict:
    """Figures of the decode steps (step 1 on: step 0 is the prompt's last token, as in `edge0 run --json`);
    load counts and bytes are every bundle read (whole-layer prefill reads apart), as --json's."""
    spans = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e["name"] == "step" and e["args"].get("step", 1) >= 1), key=lambda e: e["ts"])
    starts = np.array([e["ts"] for e in steps])
    ends = np.array([e["ts"] + e["dur"] for e in steps])

    by = defaultdict(list)  # spans inside decode steps, by kind
    for e in spans:
        if e["name"] != "step" and _within(e, starts, ends):
            kind = "eval" if e["name"].startswith(("eval L", "queue L")) or e["name"] == "pull" else e["name"]
            by[kind].append(e)
    n = len(steps)
    reads = [e for e in spans if e["name"] == "read" and not e["args"].get("whole_layer")]
    ms = np.array([e["dur"] / 1e3 for e in reads])
    cold = np.array([e["args"].get("cold", 0.0) for e in reads])
    nbytes = np.array([e["args"].get("bytes", 0) for e in reads], dtype=np.float64)
    predictions = [e for e in data["traceEvents"] if e.get("ph") == "i" and e.get("name") == "prediction"]
    hits = sum(e["args"]["hits"] for e in predictions)
    routed = hits + sum(e["args"]["misses"] for e in predictions)
    total = {k: sum(e["dur"] for e in v) / 1e3 for k, v in by.items()}
    step_ms = sum(e["dur"] for e in steps) / 1e3
    per = (lambda x: x / n) if n else (lambda x: 0.0)
    decode_reads = [e for e in by["read"] if not e["args"].get("whole_layer")]
    busy_ms, depth = _busy(decode_reads)
    decode_bytes = sum(e["args"].get("bytes", 0) for e in decode_reads)
    last = min((e for e in spans if e["name"] == "step" and e["args"].get("step") == 0), key=lambda e: e["ts"],
               default=None)  # the prompt's last token: the step that yields the first token, in the prompt's time
    mbps = decode_bytes / 1e3 / busy_ms if busy_ms else 0.0  # MB/s while any decode read was running
    return {
        "prompt_last_step_ms": last["dur"] / 1e3 if last else None,
        "steps": n,
        "tok_s": 1e3 * n / step_ms if step_ms else 0.0,
        "step_ms": per(step_ms),
        "stall_ms_per_token": per(total.get("stall", 0.0)),
        "sched_ms_per_token": per(total.get("sched", 0.0)),
        "plan_ms_per_token": per(total.get("plan", 0.0)),
        # the scheduler's event loop (sched/loop.py): its work, and the graph-building thread's waits for it
        "loop_ms_per_token": per(sum(e["dur"] for e in spans if e.get("cat") == "loop" and _within(e, starts, ends))
                                 / 1e3),
        "loop_wait_ms_per_token": per(total.get("loop wait", 0.0)),
        **_layers(by, lambda e: _step_of(e, starts), per),
        "loads": len(reads),
        "loads_per_step": per(len(decode_reads)),
        "demand_loads": sum(1 for e in reads if e["args"].get("demand")),
        "mib_per_load": float(nbytes.mean() / 2**20) if len(reads) else 0.0,
        "load_bytes": int(nbytes.sum()),
        "cold_fraction": float((cold * nbytes).sum() / nbytes.sum()) if nbytes.sum() else 0.0,
        "read_mb_s": mbps,
        "read_depth": depth,
        "read_ms_per_step": per(busy_ms),
        "eval_ms_per_step": per(total.get("eval", 0.0)),
        "graph_build_ms_per_step": per(max(step_ms - sum(total.get(k, 0.0) for k in ("eval", "stall", "sched",
                                                                                    "head+sample")), 0.0)),
        "recall": hits / routed if routed else None,
        "load_cost_fit": fit_load_cost(ms, cold),
    }


def _layers(by: dict, step_of, per) -> dict:
    """A routed layer's scheduler work on the graph-building thread in a step (the median and the least us of its
    `sched` spans), where it read nothing on demand and where it did, and how many of each a step (`per`)."""
    layer_us = defaultdict(float)  # (step, layer) -> us
    for e in by["sched"]:
        if e["args"].get("layer", -1) >= 0:
            layer_us[(step_of(e), e["args"]["layer"])] += e["dur"]
    demand = {(step_of(e), e["args"].get("layer")) for e in by["stall"] if e["args"].get("why") == "demand"}
    held = [us for k, us in layer_us.items() if k not in demand]  # its experts held, or read ahead
    missed = [us for k, us in layer_us.items() if k in demand]
    out = {}
    for name, us in (("layer", held), ("demand_layer", missed)):
        out[f"{name}_sched_us"] = float(np.median(us)) if us else None
        out[f"{name}_sched_min_us"] = float(min(us)) if us else None  # the floor of this path as it runs
        out[f"{name}s_per_step"] = per(len(us))
    return out


def windows(data: dict, size: int) -> list[dict]:
    """The decode steps (as `summarize` takes them) in windows of `size`: each window's first step, its steps'
    median, shortest and longest (ms), and per step its stall (ms), its bundle reads and of them the reads ahead
    (by the step in which they started), with the median read's ms. A run's trend, or the stretches the read-ahead
    gate compares."""
    spans = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e["name"] == "step" and e["args"].get("step", 1) >= 1), key=lambda e: e["ts"])
    if not steps:
        return []
    starts = np.array([e["ts"] for e in steps])
    ends = np.array([e["ts"] + e["dur"] for e in steps])
    stall, reads = np.zeros(len(steps)), [[] for _ in steps]
    for e in spans:
        if not _within(e, starts, ends):  # inside a decode step, as `summarize` counts
            continue
        i = _step_of(e, starts)
        if e["name"] == "stall":
            stall[i] += e["dur"] / 1e3
        elif e["name"] == "read" and not e["args"].get("whole_layer"):
            reads[i].append(e)
    out = []
    for a in range(0, len(steps), size):
        ms = np.array([e["dur"] / 1e3 for e in steps[a:a + size]])
        got = [e for r in reads[a:a + size] for e in r]
        n = len(ms)
        out.append({"first_step": a + 1, "steps": n, "step_ms": float(np.median(ms)), "min_step_ms": float(ms.min()),
                    "max_step_ms": float(ms.max()), "stall_ms_per_step": float(stall[a:a + size].sum() / n),
                    "loads_per_step": len(got) / n,
                    "ahead_per_step": sum(1 for e in got if not e["args"].get("demand")) / n,
                    "read_ms": float(np.median([e["dur"] / 1e3 for e in got])) if got else None})
    return out


def bursts(reads: list[tuple[float, float]]) -> list[list[float]]:
    """The union of read intervals (start, end): disjoint bursts in time order."""
    out: list[list[float]] = []
    for s, t in sorted(reads):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], t)
        else:
            out.append([s, t])
    return out


def _busy(reads: list[dict]) -> tuple[float, float]:
    """(ms during which at least one read ran, mean reads in flight over that time)."""
    iv = [(e["ts"], e["ts"] + e["dur"]) for e in reads]
    busy = sum(t - s for s, t in bursts(iv))
    return busy / 1e3, sum(t - s for s, t in iv) / busy if busy else 0.0


def plot(data: dict, summary: dict, out: str | Path, steps: int = 4) -> None:
    """Timeline of the first few decode steps (a lane per thread) and the load-cost fit, to PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Edge0Error("--plot needs matplotlib: pip install matplotlib") from None
    events = data["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    step_spans = sorted((e for e in events if e.get("ph") == "X" and e["name"] == "step"), key=lambda e: e["ts"])
    if not step_spans:
        raise Edge0Error("trace has no decode steps to plot")
    first = step_spans[min(1, len(step_spans) - 1)]  # skip the step that follows prefill
    t0 = first["ts"]
    t1 = step_spans[min(len(step_spans) - 1, steps)]["ts"] + step_spans[min(len(step_spans) - 1, steps)]["dur"]
    colors = {"compute": "tab:blue", "io": "tab:orange", "stall": "tab:red", "sample": "tab:green", "sched": "tab:purple",
              "loop": "tab:brown"}
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [2, 1]})
    order = sorted(lanes)
    for e in events:
        if e.get("ph") != "X" or e["cat"] not in colors or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
            continue
        y = order.index(e["tid"])
        ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, color=colors[e["cat"]], height=0.6)
    ax.set_yticks(range(len(order)), [lanes[t] for t in order])
    ax.set_xlabel("ms")
    ax.set_title("decode timeline: waits for MLX (blue), reads (orange), stalls (red), scheduler (purple), "
                 "head+sample (green)")
    reads = [e for e in events if e.get("ph") == "X" and e["name"] == "read" and not e["args"].get("whole_layer")]
    cold = np.array([e["args"].get("cold", 0.0) for e in reads])
    ms = np.array([e["dur"] / 1e3 for e in reads])
    bx.scatter(cold, ms, s=8, alpha=0.5)
    fit = summary["load_cost_fit"]
    if fit["a_ms"] is not None:
        xs = np.linspace(0, 1, 20)
        bx.plot(xs, fit["a_ms"] + fit["b_ms"] * xs, color="black",
                label=f"{fit['a_ms']:.2f} + {fit['b_ms']:.2f} x cold ms")
        bx.legend()
    bx.set_xlabel("cold fraction of the load")
    bx.set_ylabel("load ms")
    fig.tight_layout()
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            fig.savefig(tmp, dpi=100, format=out.suffix[1:].lower())
    except OSError as e:  # the parent could not be made (a write's own errors are said by atomic_path)
        raise write_error(out, e) or Edge0Error(f"{out}: cannot be written ({e.strerror})") from None
    finally:
        plt.close(fig)


def check_plot(out: str, trace: str) -> None:
    """--plot's file: a format drawn here, not the trace itself, and over an existing file only a plot of its
    format (drawn again without a flag, as before)."""
    ext = Path(out).suffix.lower()
    if ext not in PLOT_FORMATS:
        raise Edge0Error(f"--plot {out}: {repr(ext) if ext else 'no extension'} is not a format it draws; name a "
                         f"{', '.join(list(PLOT_FORMATS)[:-1])} or {list(PLOT_FORMATS)[-1]} file")
    refuse_inputs(out, {"FILE": trace}, "--plot")
    name = ext[1:].upper()
    check_file_out(out, None, Kind(f"a {name} image", f"{name} header", starts_with(*PLOT_FORMATS[ext])), "--plot")
