"""`edge0 bench --serve`: N concurrent streaming clients against `edge0 serve`, continuous batching against FIFO.

    edge0 bench --serve --clients 8 [--model STORE] [--max-batch 8] [--requests 4] [--max-tokens 32] [--rounds 3]

Each arm is a server process of its own (`edge0 serve --port 0 --max-batch B`; FIFO is --max-batch 1). It is
warmed with one request, then timed alone (time to first token of an idle server, two solo requests), then
loaded: --clients clients of the official openai package each send --requests streaming completions one
after another, every prompt a different chunk of Python standard-library source (--prompt-tokens long, no
shared prefix for the prompt cache to find), EOS ignored so that every request generates --max-tokens.
Arms alternate order over --rounds rounds; the medians over rounds are reported.

Figures per arm: aggregate tok/s (generated tokens over the load's wall time, prefills included), time to
first token p50/p95 (sent to first text), per-token latency p50/p95 (a request's first-to-last text time over
its tokens - 1), bytes read per generated token (edge0_bytes_read_total over edge0_completion_tokens_total
of /metrics, across the load), the server's peak RSS. Until `edge0 serve` has --max-batch only FIFO runs.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib
import inspect
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .harness import medians, schedule
from ..errors import Edge0Error
from ..io.atomic import write_atomic

START_TIMEOUT_S = 600.0  # loading a large store
REQUEST_TIMEOUT_S = 3600.0
IDLE_SAMPLES = 2  # solo requests timed on the idle server
SOURCES = ("argparse", "json.decoder", "textwrap", "difflib", "csv", "shlex", "heapq", "statistics", "fractions",
           "pprint", "ast", "bisect")  # the standard library's own text: real code, the same on every machine
FIGURES = ("tok_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms", "bytes_per_token", "idle_ttft_ms",
           "peak_rss_gib", "peak_mlx_gib", "resident_expert_gib", "wall_s", "tokens", "server_cpu_ms_per_token",
           "client_cpu_ms_per_token")



def check_args(args) -> Path:
    """The flags checked before anything starts; the store to serve."""
    for flag, value in (("--clients", args.clients), ("--requests", args.requests), ("--rounds", args.rounds),
                        ("--max-tokens", args.max_tokens), ("--prompt-tokens", args.prompt_tokens)):
        if value < 1:
            raise Edge0Error(f"{flag} {value}: must be at least 1")
    if args.max_batch is not None and args.max_batch < 1:
        raise Edge0Error(f"--max-batch {args.max_batch}: must be at least 1")
    if args.model is None:
        from ..engine import demo_store

        return demo_store()
    from ..io.manifest import read_manifest

    read_manifest(Path(args.model))  # a missing or broken store is said now, before a server starts
    return Path(args.model)


def has_max_batch() -> bool:
    """Whether this `edge0 serve` takes --max-batch (continuous batching)."""
    proc = subprocess.run([sys.executable, "-m", "edge0.cli", "serve", "--help"], capture_output=True, text=True)
    return "--max-batch" in proc.stdout


def prompts(store: Path, n: int, length: int) -> list[str]:
    """n texts of `length` tokens each, cut from standard-library source at different places."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(store)
    ids = tok.encode("\n".join(inspect.getsource(importlib.import_module(m)) for m in SOURCES))
    if len(ids) < 2 * length:
        raise Edge0Error(f"--prompt-tokens {length}: longer than the prompt text allows ({len(ids) // 2})")
    span = len(ids) - length
    step = max(span // n, 1) if n * length > span else length  # wraps around only when the text runs out
    return [tok.decode(ids[(i * step) % span:(i * step) % span + length]) for i in range(n)]


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile, linear between order statistics (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return 0.0
    at = (len(xs) - 1) * q / 100
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


# -- one server -----------------------------------------------------------------------------------------


class Server:
    """`edge0 serve --port 0 FLAGS` as a subprocess; its URL is read from its start-up line in its log."""

    def __init__(self, flags: list[str], log: Path):
        self.log = log
        env = {k: v for k, v in os.environ.items() if k != "EDGE0_API_KEY"}  # on loopback, its clients send none
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "edge0.cli", "serve", "--port", "0", *flags],
                                         stdout=subprocess.DEVNULL, stderr=err, env=env)
        end = time.monotonic() + START_TIMEOUT_S
        while not (m := re.search(r"(http://[0-9.]+:\d+)/v1", log.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                tail = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise Edge0Error(f"edge0 serve {' '.join(flags)} did not start: {tail}")
            time.sleep(0.1)
        self.url = m.group(1)
        self.model = self.get("/health")["model"]

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            text = r.read().decode()
        return json.loads(text) if path != "/metrics" else text

    def metric(self, name: str) -> float:
        text = self.get("/metrics")
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"edge0_{name} ")))

    def peak_rss_gib(self) -> float | None:
        """The server process's peak resident memory (Linux), read while it runs."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), None)
        return kib / 2**20 if kib is not None else None

    def cpu_s(self) -> float | None:
        """The server process's CPU time so far, every thread, user and system (Linux)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming completion: when it was sent, its first and last text, its tokens."""
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first, last = first or now, now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first, last = first or end, last or end
    return {"sent": sent, "end": end, "ttft_s": first - sent, "tokens": tokens,
            "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None}


async def load(url: str, model: str, texts: list[list[str]], max_tokens: int) -> list[dict]:
    """len(texts) clients, client i sending texts[i] one after another; every request's timings."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)

    async def run_client(mine: list[str]) -> list[dict]:
        return [await one_request(client, model, text, max_tokens) for text in mine]

    try:
        per_client = await asyncio.gather(*(run_client(mine) for mine in texts))
    finally:
        await client.close()
    return [r for rs in per_client for r in rs]


# -- one arm: a server started, warmed, timed idle, loaded, stopped ------------------------------------------


def serve_flags(args, store: Path, max_batch: int | None) -> list[str]:
    flags = ["--model", str(store), "--max-queue", str(max(32, args.clients))]
    if max_batch is not None:
        flags += ["--max-batch", str(max_batch)]
    if args.memory_budget is not None:
        flags += ["--memory-budget", str(args.memory_budget)]
    if args.io_throttle is not None:
        flags += ["--io-throttle", str(args.io_throttle)]
    if args.dtype != "auto":
        flags += ["--dtype", args.dtype]
    if args.threads:
        flags += ["--kernel-threads", str(args.threads)]
    return flags


def run_arm(args, store: Path, max_batch: int | None, texts: dict, log: Path) -> dict:
    """The figures of one server under load (see the module's docstring)."""
    server = Server(serve_flags(args, store, max_batch), log)
    try:
        asyncio.run(load(server.url, server.model, [[texts["warm"]]], args.max_tokens))
        idle = asyncio.run(load(server.url, server.model, [texts["idle"]], args.max_tokens))
        before = [server.metric(m) for m in ("bytes_read_total", "completion_tokens_total")]
        cpu0 = server.cpu_s(), time.process_time()
        start = time.perf_counter()
        results = asyncio.run(load(server.url, server.model, texts["load"], args.max_tokens))
        wall = max(r["end"] for r in results) - start
        cpu1 = server.cpu_s(), time.process_time()
        after = [server.metric(m) for m in ("bytes_read_total", "completion_tokens_total")]
        rss = server.peak_rss_gib()
        mlx, experts = (server.metric(m) / 2**30 for m in ("peak_mlx_bytes", "resident_expert_bytes"))
    except Exception as e:
        if isinstance(e, Edge0Error):
            raise
        raise Edge0Error(f"the load on edge0 serve failed ({type(e).__name__}: {e}); its log: {log}") from None
    finally:
        server.stop()
    tokens = sum(r["tokens"] for r in results)
    # CPU per generated token under the load: the server's, and the clients' (this process: on a small machine the
    # clients take cores the server would use)
    server_cpu = 1e3 * (cpu1[0] - cpu0[0]) / max(tokens, 1) if None not in (cpu0[0], cpu1[0]) else None
    client_cpu = 1e3 * (cpu1[1] - cpu0[1]) / max(tokens, 1)
    tpot = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    ttft = [r["ttft_s"] for r in results]
    return {"tok_s": tokens / wall, "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p95_ms": 1e3 * percentile(ttft, 95),
            "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p95_ms": 1e3 * percentile(tpot, 95),
            "bytes_per_token": (after[0] - before[0]) / max(after[1] - before[1], 1),
            "idle_ttft_ms": 1e3 * statistics.median(r["ttft_s"] for r in idle), "peak_rss_gib": rss,
            "peak_mlx_gib": mlx, "resident_expert_gib": experts, "wall_s": wall,
            "tokens": tokens, "requests": len(results), "max_batch": max_batch,
            "server_cpu_ms_per_token": server_cpu, "client_cpu_ms_per_token": client_cpu}


# -- the benchmark ------------------------------------------------------------------------------------------


def arms_to_run(args) -> tuple[dict[str, int | None], str | None]:
    """{arm: its --max-batch (None: the flag is not passed)}, and a note when only FIFO runs."""
    if not has_max_batch():
        return {"fifo": None}, "edge0 serve has no --max-batch yet: only the FIFO arm runs"
    batch = args.max_batch or args.clients
    if batch == 1:
        return {"fifo": 1}, "--max-batch 1 is FIFO: only the FIFO arm runs"
    return {"batched": batch, "fifo": 1}, None


def bench_serve(args) -> int:
    store = check_args(args)
    from . import results_dir

    out = results_dir(args.out, {"--model": store}, "bench-serve")
    arms, note = arms_to_run(args)
    if note:
        print(f"note: {note}", file=sys.stderr)
    n, r = args.clients, args.requests
    every = prompts(store, 1 + IDLE_SAMPLES + n * r, args.prompt_tokens)
    texts = {"warm": every[0], "idle": every[1:1 + IDLE_SAMPLES],
             "load": [every[1 + IDLE_SAMPLES + i * r:1 + IDLE_SAMPLES + (i + 1) * r] for i in range(n)]}
    runs: dict[str, list[dict]] = {}
    names = list(arms)
    for k, _, arm in schedule(names, args.rounds):  # the arms' order rotated round by round
        res = run_arm(args, store, arms[arm], texts, out / f"serve-{arm}-{k + 1}.log")
        runs.setdefault(arm, []).append(res)
        print(f"round {k + 1} {arm:8s}: {res['tok_s']:.2f} tok/s, TTFT p50 {res['ttft_p50_ms']:.0f} ms, "
              f"{res['tpot_p50_ms']:.1f} ms/token, {res['bytes_per_token'] / 2**20:.2f} MiB read/token",
              file=sys.stderr)
    summary = {arm: s | {"max_batch": arms[arm]} for arm, s in medians(runs, FIGURES).items()}
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cores": os.cpu_count(),
            "load_avg": os.getloadavg()[0], "model": str(store), "clients": n, "requests_per_client": r,
            "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "note": note,
            "memory_budget_gib": args.memory_budget}
    ratios = compare(summary)
    write_atomic(out / "results.json", json.dumps({"meta": meta, "median": summary, "ratios": ratios, "runs": runs},
                                                  indent=1).encode())
    lines = table(summary, ratios, meta)
    write_atomic(out / "results.md", ("\n".join(lines) + "\n").encode())
    print("\n".join(lines))
    print(f"\nwrote {out}/results.json and results.md", file=sys.stderr)
    return 0


def compare(summary: dict) -> dict:
    """The batched arm against FIFO (both measured in this run), and its TTFT against its own idle server."""
    b, f = summary.get("batched"), summary["fifo"]
    if b is None:
        return {}
    return {"tok_s_vs_fifo": b["tok_s"] / f["tok_s"], "ttft_p50_vs_idle": b["ttft_p50_ms"] / b["idle_ttft_ms"],
            "bytes_per_token_vs_fifo": b["bytes_per_token"] / f["bytes_per_token"] if f["bytes_per_token"] else None}


def table(summary: dict, ratios: dict, meta: dict) -> list[str]:
    """The markdown of results.md."""
    lines = [f"{meta['clients']} clients x {meta['requests_per_client']} streaming requests, {meta['max_tokens']} "
             f"tokens each after {meta['prompt_tokens']}-token prompts, {meta['model']}; medians of {meta['rounds']} "
             f"rounds; {meta['cores']} cores, load average {meta['load_avg']:.1f} at the start", "",
             "| arm | --max-batch | tok/s | TTFT p50 ms | TTFT p95 ms | ms/token p50 | ms/token p95 | MiB read/token "
             "| idle TTFT ms | peak RSS GiB | peak MLX GiB | resident experts MiB | server CPU ms/token "
             "| clients' CPU ms/token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in summary.items():
        rss = f"{s['peak_rss_gib']:.2f}" if s["peak_rss_gib"] is not None else "-"
        server_cpu = f"{s['server_cpu_ms_per_token']:.2f}" if s.get("server_cpu_ms_per_token") is not None else "-"
        lines.append(f"| {arm} | {s['max_batch'] or '-'} | {s['tok_s']:.2f} | {s['ttft_p50_ms']:.0f} | "
                     f"{s['ttft_p95_ms']:.0f} | {s['tpot_p50_ms']:.1f} | {s['tpot_p95_ms']:.1f} | "
                     f"{s['bytes_per_token'] / 2**20:.3f} | {s['idle_ttft_ms']:.0f} | {rss} | "
                     f"{s['peak_mlx_gib']:.3f} | {1024 * s['resident_expert_gib']:.1f} | {server_cpu} | "
                     f"{s['client_cpu_ms_per_token']:.2f} |")
    if ratios:
        per_token = ratios["bytes_per_token_vs_fifo"]
        read = f", {per_token:.2f}x bytes read per token" if per_token is not None else ""
        lines += ["", f"batched / FIFO: {ratios['tok_s_vs_fifo']:.2f}x tok/s{read}",
                  f"batched TTFT p50 / idle TTFT: {ratios['ttft_p50_vs_idle']:.2f}x"]
    budget = meta["memory_budget_gib"]
    if budget is not None:
        held = max(s["resident_expert_gib"] for s in summary.values())
        lines += ["", f"resident experts after the load: at most {1024 * held:.1f} MiB of the {1024 * budget:.1f} MiB "
                  f"--memory-budget ({'inside' if held <= budget else 'OVER'})"]
    if meta["note"]:
        lines += ["", f"note: {meta['note']}"]
    return lines
