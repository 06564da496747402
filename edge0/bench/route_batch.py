"""`edge0 bench --routes A,B,.. --batch 2,4,8`: a batch over streamed experts on real routing, each row forced from its
own trace window, against the same sequences served one after another on the same memory.

    edge0 bench --store olmoe --arms staged --routes seed1.json,seed2.json,seed3.json --batch 2,4,8 \
        --slots 16 --io direct --io-throttle 1000 --max-tokens 32 --prompt-tokens 4

Sequence i follows window i: the files taken in turn, each cut into windows of (prompt + max tokens - 1) rows (a
window after a file's first starts mid-generation: a real model's routing all the same). Every run opens a fresh
engine (empty banks). The batch's decode time runs from its first batched step to its last (each row's prompt and
first token run alone at admission, as the server admits them); the serial figure is the sum of the same sequences'
decode times, one generation after another on one engine. `choose`: the batch runs its sequences in groups of
compute/runtime.py batch_rows (the rule that keeps a batch from being slower than its sequences one after another).
"""

from __future__ import annotations

import math
import time

from ..compute.runtime import batch_rows
from ..errors import Edge0Error


def windows(traces: list, count: int, rows: int) -> list:
    """`count` RouteTraces of `rows` rows: the files' windows in turn (file 0's first, file 1's first, .., file 0's
    second, ..); refused by name where the files hold too few."""
    from ..io.routetrace import RouteTrace

    per = [t.num_tokens // rows for t in traces]
    if sum(per) < count:
        raise Edge0Error(f"--routes: {count} sequences of {rows} rows need {count} windows; the traces hold "
                         f"{sum(per)}")
    out, w = [], 0
    while len(out) < count:
        for t, n in zip(traces, per):
            if w < n and len(out) < count:
                ids = t.ids[:, w * rows:(w + 1) * rows]
                weights = None if t.weights is None else t.weights[:, w * rows:(w + 1) * rows]
                out.append(RouteTrace(ids, weights, t.layers, t.num_experts))
        w += 1
    return out


def prompts(count: int, length: int) -> list[list[int]]:
    """A different prompt per sequence (routing is forced: the ids only feed attention)."""
    return [[100 + 7 * i + j for j in range(length)] for i in range(count)]


def run_batch(config, rows: list, prompt: list[list[int]], max_tokens: int, group: int) -> dict:
    """Decode the sequences in batches of `group` rows (one after another), on a fresh engine: decode tokens,
    seconds of batched steps, bytes read during them."""
    from ..decode.batch import BatchDecoder
    from ..engine import open_engine
    from ..model.traced import TracedRouting

    tokens = secs = nbytes = 0.0
    with open_engine(config) as engine:
        engine.prompt_cache = None
        for lo in range(0, len(rows), group):
            part = rows[lo:lo + group]
            traced = TracedRouting(engine.store.model, traces=part, what="--routes")
            try:
                batch = BatchDecoder(engine, len(part))
                for i, p in enumerate(prompt[lo:lo + group]):
                    traced.admit(i)
                    batch.admit(engine.request(p, max_tokens=max_tokens, ignore_eos=True), lambda s: None,
                                lambda: False)
                b0, t0 = engine.store.reader.stats.bytes, time.perf_counter()
                while batch.seqs:
                    batch.step()
                batch.settle()
                secs += time.perf_counter() - t0
                nbytes += engine.store.reader.stats.bytes - b0
                tokens += len(part) * (max_tokens - 1)
            finally:
                traced.detach()
    return {"tokens": tokens, "seconds": secs, "bytes": nbytes}


def run_serial(config, rows: list, prompt: list[list[int]], max_tokens: int) -> list[dict]:
    """Each sequence alone, one after another on one fresh engine: its decode tokens, seconds and bytes."""
    from ..engine import open_engine
    from ..model.traced import TracedRouting

    out = []
    with open_engine(config) as engine:
        engine.prompt_cache = None
        for trace, p in zip(rows, prompt):
            traced = TracedRouting(engine.store.model, trace=trace, what="--routes")
            try:
                b0 = engine.store.reader.stats.bytes
                fig = engine.generate(engine.request(p, max_tokens=max_tokens, ignore_eos=True))
                n = len(fig.tokens) - 1
                out.append({"tokens": n, "seconds": n / fig.decode_tok_s if fig.decode_tok_s else math.nan,
                            "bytes": engine.store.reader.stats.bytes - b0})
            finally:
                traced.detach()
    return out


ARM_SETTINGS = {  # the arms a batch runs as: their EngineConfig settings (streamed banks, --slots their size)
    "staged": {"routing.mode": "native"}, "staged:lru": {"routing.mode": "native", "io.evict": "lru"},
    "prefetch:affinity": {"routing.mode": "prefetch", "routing.predictor": "affinity"},
}


def batch_config(args, arm: str, rows: int):
    """The EngineConfig of `arm` over --store with the bench's I/O flags, for batches of `rows`."""
    from ..config import EngineConfig

    if arm not in ARM_SETTINGS:
        raise Edge0Error(f"--batch: --arms {arm}: a batch runs one of {', '.join(ARM_SETTINGS)}")
    settings = {"model": str(args.store), "io.executor": "staged", "io.slots": args.slots, "io.mode": args.io or "pread",
                "io.throttle_mbps": args.io_throttle, "serving.max_batch": rows, **ARM_SETTINGS[arm]}
    if arm == "prefetch:affinity":
        settings["routing.affinity"] = args.affinity
    return EngineConfig.of(settings).check()


def bench_batches(args) -> list[str]:
    """--batch SIZES: per round (rotated), the sequences one after another, each size's batch, and where batch_rows
    chooses fewer rows, the batch run in groups of that size; the medians as lines of a results table."""
    import statistics

    from ..io.manifest import read_manifest
    from ..io.routetrace import check_fits, read_trace

    sizes = sorted({int(s) for s in str(args.batch).split(",") if s.strip().isdigit()})
    arms = (args.arms or "").split(",")
    if not sizes or min(sizes) < 2 or len(arms) != 1 or not (args.routes and args.slots and args.store):
        raise Edge0Error(f"--batch {args.batch}: sizes of 2 or more, comma-separated, with one arm (--arms), "
                         "--store, --routes FILE[,FILE..] and --slots")
    m = read_manifest(args.store)
    traces = [read_trace(f, f"--routes {f}") for f in str(args.routes).split(",")]
    for f, t in zip(str(args.routes).split(","), traces):  # another model's trace indexed past the banks
        check_fits(t, f"--routes {f}", layers=len(m.layers), experts=m.num_experts, top_k=m.top_k, tokens=0)
    n = args.prompt_tokens + args.max_tokens - 1
    rows = windows(traces, max(sizes), n)
    prompt = prompts(max(sizes), args.prompt_tokens)
    chosen = {b: batch_rows(b, slots=args.slots, experts=m.num_experts, top_k=m.top_k) for b in sizes}
    runs = [("serial", max(sizes), 1)] + [("batch", b, b) for b in sizes] + [
        ("chosen", b, g) for b, g in chosen.items() if g < b]
    got: dict = {r: [] for r in runs}
    for r in range(args.rounds):
        for run in runs[r % len(runs):] + runs[:r % len(runs)]:
            kind, b, g = run
            config = batch_config(args, arms[0], b if kind == "batch" else g)
            got[run].append(run_serial(config, rows[:b], prompt[:b], args.max_tokens) if kind == "serial" else
                            run_batch(config, rows[:b], prompt[:b], args.max_tokens, g))
    serial = got[runs[0]]

    def alone(b: int) -> float:  # tok/s of the first b sequences one after another, median over rounds
        return statistics.median(sum(s["tokens"] for s in one[:b]) / sum(s["seconds"] for s in one[:b]) for one in serial)

    def rate(run) -> tuple[float, float]:
        return (statistics.median(x["tokens"] / x["seconds"] for x in got[run]),
                statistics.median(x["bytes"] / x["tokens"] / 2**20 for x in got[run]))

    lines = ["", f"Batches over streamed experts, each row forced from its own window of {args.routes} ({n} rows), "
                 f"{arms[0]}, {args.slots} slots, median of {args.rounds} rounds; aggregate decode tok/s", "",
             "| sequences | one after another | batch | batch / alone | MiB/token | chosen rows | chosen | chosen / alone |",
             "|---|---|---|---|---|---|---|---|"]
    for b in sizes:
        a, (t, mib) = alone(b), rate(("batch", b, b))
        c = f"{chosen[b]} | {rate(('chosen', b, chosen[b]))[0]:.2f} | {rate(('chosen', b, chosen[b]))[0] / a:.2f}x" \
            if chosen[b] < b else f"{b} | - | -"
        lines.append(f"| {b} | {a:.2f} | {t:.2f} | {t / a:.2f}x | {mib:.1f} | {c} |")
    return lines
