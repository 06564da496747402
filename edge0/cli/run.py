"""`edge0 run` (also `python -m edge0.run`): generate text from an Edge0 store, streaming tokens.

    python -m edge0.run --prompt "def fib(n):" --max-tokens 32
    edge0 run --model ~/stores/qwen3-30b --cold --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..errors import Edge0Error
from ..config.checks import not_utf8, refuse_together
from ..model.demo import DEMO_PROMPT as DEFAULT_PROMPT
from .flags import add_engine_flags, add_log_flags, add_route_flags, add_sampling_flags, engine_config, route_files, sampling


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    p.add_argument("--prompt", default=None, help="prompt text; - reads it from standard input (default: a short Python "
                   "prompt)")
    p.add_argument("--prompt-file", metavar="FILE", default=None, help="read the prompt text from FILE (UTF-8)")
    add_sampling_flags(p, max_tokens=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--replay", metavar="FILE", default=None,
                   help='JSON {"prompt": [ids], "tokens": [ids]}: fixed prompt ids and forced decode tokens (benchmarks)')
    p.add_argument("--trace", metavar="PATH", default=None,
                   help="write a Chrome trace-event timeline (Perfetto); analyse with `edge0 trace summarize PATH`")
    add_route_flags(p)
    p.add_argument("--json", action="store_true", help="print only one JSON object with the tokens and figures, at the end")
    add_log_flags(p)


def read_replay(path: str) -> dict:
    """--replay FILE: {"prompt": [ids], "tokens": [ids]}: a fixed prompt and forced decode tokens (benchmarks)."""
    from ..io.manifest import read_json

    if not Path(path).is_file():
        raise Edge0Error(f"--replay {path}: no such file")
    data = read_json(Path(path))
    ok = isinstance(data, dict) and not set(data) - {"prompt", "tokens"} and all(
        isinstance(data.get(k, []), list) and all(type(t) is int and t >= 0 for t in data.get(k, []))
        for k in ("prompt", "tokens"))
    if not ok or not data.get("prompt"):
        raise Edge0Error(f"{path}: expected {{\"prompt\": [token ids], \"tokens\": [token ids]}} and nothing else")
    return data


def read_prompt(args: argparse.Namespace) -> tuple[str | None, str]:
    """The prompt text of --prompt (- : standard input) or --prompt-file, read before the model loads, and the words
    that name it in an error. Text that is not UTF-8 is refused here: the tokenizer would raise on it."""
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise Edge0Error("--prompt and --prompt-file: give one of them")
        what, path = f"--prompt-file {args.prompt_file}", Path(args.prompt_file)
        if not path.is_file():
            raise Edge0Error(f"{what}: {'a directory, not a file' if path.is_dir() else 'no such file'}")
        try:
            text = path.read_bytes().decode("utf-8", "surrogateescape")
        except OSError as e:
            raise Edge0Error(f"{what}: cannot be read ({e.strerror or e})") from None
    elif args.prompt == "-":
        what, text = "--prompt - (standard input)", sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    else:
        what, text = "--prompt", args.prompt
    bad = not_utf8(text) if text is not None else None
    if bad is not None:
        raise Edge0Error(f"{what}: not UTF-8 text (byte {bad})")
    return text, what


def _creatable(d: Path) -> bool:
    """d exists and is writable, or can be made inside the nearest existing, writable ancestor."""
    while not d.exists() and d != d.parent:
        d = d.parent
    return d.is_dir() and os.access(d, os.W_OK)


def _check_trace(args) -> None:
    """--trace lies in no input (the store included) and replaces only an earlier trace."""
    from ..io.outputs import Kind, check_file_out, refuse_inputs, starts_with
    from ..model.demo import DEMO_STORE

    lora = None if args.lora == "none" else args.lora
    refuse_inputs(args.trace, {"--model": args.model or DEMO_STORE, "--prompt-file": args.prompt_file,
                               "--replay": args.replay, "--heads": args.heads, "--lora": lora}, "--trace")
    check_file_out(args.trace, None, Kind("a trace", "traceEvents", starts_with(b'{"traceEvents"')), "--trace")


def _prompt(engine, args, replay: dict | None) -> list[int]:
    if replay is not None:
        return replay["prompt"]
    text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if args.chat:
        return engine.encode_chat([{"role": "user", "content": text}])
    return engine.encode_text(text)


def main(args: argparse.Namespace) -> int:
    from ..dist import open_engine  # under mlx.launch: this rank's share of a pipeline
    from ..dist.routes import rank_routes, refuse_record
    from ..engine import memory_figures
    from ..decode.request import GenRequest
    from ..model.traced import attach_routes, save_routes
    from ..sched.trace import NULL, Trace

    t0 = time.perf_counter()
    routes = route_files(args)  # --routes sets native routing where --routing is not given
    refuse_record(args.record_routes)
    config, samp = engine_config(args), sampling(args)
    if args.replay:  # its prompt is token ids: text or a template would be dropped without a word
        for flag, given in (("--prompt", args.prompt is not None), ("--prompt-file", args.prompt_file is not None),
                            ("--chat", args.chat)):
            if given:
                refuse_together("--replay", flag, "the replay file holds the prompt (token ids); give one")
    args.prompt, prompt_what = read_prompt(args)
    replay = read_replay(args.replay) if args.replay else None
    if args.trace and (Path(args.trace).is_dir() or not _creatable(Path(args.trace).resolve().parent)):
        raise Edge0Error(f"--trace {args.trace}: not a writable file path")
    if args.trace:
        _check_trace(args)
    trace = Trace({"model": str(args.model or "demo")}) if args.trace else NULL
    with open_engine(config, trace=trace, routes=routes, routes_file=args.routes) as engine:
        if trace.on:
            trace.meta.update(routing=engine.config.routing.mode, predictor=engine.config.routing.predictor)
        load_s = time.perf_counter() - t0
        samp.check_context(engine.context)  # serve's check too: one range for the flag
        req = GenRequest(prompt=_prompt(engine, args, replay), max_tokens=samp.max_tokens, temp=samp.temp,
                         top_p=samp.top_p, seed=samp.seed, ignore_eos=args.ignore_eos, **samp.penalties(),
                         forced=(replay.get("tokens") or None) if replay else None)
        engine.check(req, what=args.replay if replay else prompt_what)
        traced = attach_routes(engine, rank_routes(engine, routes), req, routes_file=args.routes,
                               record=args.record_routes)
        if not args.json and replay is None and not args.chat:
            print(args.prompt if args.prompt is not None else DEFAULT_PROMPT, end="", flush=True)
        emit = (lambda s: None) if args.json else (lambda s: print(s, end="", flush=True))
        fig = engine.generate(req, emit)
        save_routes(args.record_routes, traced, engine, req, fig.tokens)
        if not args.json:
            print(flush=True)
        result = _result(engine, fig, load_s, memory_figures())
        if trace.on:
            try:
                trace.save(args.trace, summary={k: result[k] for k in ("decode_tok_s", "stall_ms_per_token", "recall",
                                                                       "loads", "load_bytes", "load_cold_fraction")})
            except OSError as e:
                raise Edge0Error(f"--trace {args.trace}: cannot be written ({e.strerror or e})") from None
    if args.json:
        print(json.dumps(result))
    else:
        print(_summary(result, fig), file=sys.stderr)
    return 0


def _summary(result: dict, fig) -> str:
    """The line on stderr after the text: what ran, the prompt's and decode's speeds, what was read."""
    reads = (f"every expert resident ({result['bytes_read'] / 2**20:.1f} MiB read at load)"
             if result["executor"] == "resident" else
             f"read {result['bytes_read'] / 2**20:.1f} MiB in {result['reads']} reads "
             f"({100 * result['cold_fraction']:.0f}% cold), slot hit rate {100 * result['hit_rate']:.0f}%")
    if result.get("held_layers"):  # --placement: layers that route by their own router with every expert held
        reads += f", layers {', '.join(map(str, result['held_layers']))} holding every expert"
    if result.get("paused_steps") is not None:  # scheduled routing: how often the step read ahead (the gate)
        reads += f", read ahead at {result['read_ahead_steps']} of {result['flushed_steps']} steps"
    return (f"[edge0] {result['routing']} routing, {result['executor']}: prompt {fig.prompt_tokens} tok at "
            f"{fig.prefill_tok_s:.1f} tok/s, decode {len(fig.tokens)} tok at {fig.decode_tok_s:.2f} tok/s, "
            f"{reads}, peak MLX {result['peak_mlx_gib']:.2f} GiB")


def _result(engine, fig, load_s: float, memory: dict) -> dict:
    """`--json`'s object: the generation, the store's cumulative I/O (loading included), what ran."""
    stats, rt = engine.store.reader.stats, engine.store.runtime
    sched = getattr(rt, "sched", None)
    steps = max(len(fig.tokens) - 1, 1)  # decode steps: the first token comes out of prefill
    return {
        "tokens": fig.tokens, "text": fig.text, "prompt_tokens": fig.prompt_tokens,
        "decode_tok_s": fig.decode_tok_s, "prefill_tok_s": fig.prefill_tok_s, **memory,
        "bytes_read": stats.bytes, "reads": stats.reads, "cold_fraction": stats.cold_fraction,
        "hit_rate": rt.stats.hit_rate, "resident_expert_bytes": rt.resident_expert_bytes,
        "stall_ms_per_token": 1e3 * fig.stall_s / steps, "prefill_stall_ms": 1e3 * fig.prefill_stall_s,
        "recall": sched.stats.recall if sched else None,
        **_loads(engine.store.reader.pool, rt, steps),
        "load_s": load_s, **engine.describe(),
    }


def _loads(pool, rt, steps: int) -> dict:
    """Bundle reads through the I/O pool (every routing; whole-layer prefill reads apart) and, for scheduled
    routing, the scheduler's time on the graph-building thread and on its own (the planner's)."""
    s = pool.stats
    out = {"loads": s.loads, "demand_loads": s.demand_loads, "load_bytes": s.bytes,
           "load_cold_fraction": s.cold_fraction, "io_workers": pool.workers}
    if getattr(rt, "sched", None) is not None:
        out.update(sched_ms_per_token=1e3 * rt.sched_s / steps, sched_cpu_ms_per_token=1e3 * rt.sched_cpu_s / steps,
                   pull_ms_per_token=1e3 * rt.pull_s / steps, flushed_steps=rt.flushed_steps,
                   paused_steps=rt.paused_steps, read_ahead_steps=rt.flushed_steps - rt.paused_steps,
                   gated_steps=rt.gated_steps, read_ahead=rt.gate.summary() if rt.gate is not None else None,
                   plan_ms_per_token=1e3 * rt.plan_s / steps, plan_cpu_ms_per_token=1e3 * rt.plan_cpu_s / steps)
    return out
