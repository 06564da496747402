"""Soak test of `edge0 serve`: cycles of 100 sequential requests, 8 x 10 concurrent ones and 8 x 5 on /v1/messages
(streaming and not; 220 a cycle, 9 cycles: about 2,000) against a server subprocess with the given flags (default:
the built-in model). Every prompt is new (a shared first turn, a new last one), so the prompt cache keeps taking
entries and must evict; its budget is small enough to be full within the first 100 requests, and the server's
RSS must then stay within --rss-limit times its level after those 100 (--baseline-after). Prints failures,
tracebacks in its log and RSS per phase, and the highest RSS from the baseline on and from the end of the first
cycle on (every kind of request served once: the batched path's buffers are made then); exits 1 on a failed
request, a traceback or an RSS over the limit.

    python tools/soak_serve.py                          # the default server, --prompt-cache-gib 0.01
    python tools/soak_serve.py --cycles 2 --max-batch 8
    python tools/soak_serve.py --prompt-cache-gib 0     # the same load with the cache off
"""
import argparse
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai

PROMPTS = ["def fibonacci(n):\n    if n", "import os", "class Stack:\n    def push(self, item", "x", "for i in range(10):"]
CACHE_GIB = "0.01"  # the demo's first ~50 answers fill it: the RSS after 100 requests holds a full cache


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


class Load:
    """The requests of the soak, request i of each kind new (its last turn names i)."""

    def __init__(self, port: int):
        self.oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        self.claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0,
                                          timeout=300)
        self.model = self.oai.models.list().data[0].id  # whatever store it serves, under its own name

    def ask(self, i: int):
        """An OpenAI request: a streamed two-turn chat or a plain completion."""
        try:
            if i % 2 == 0:
                msgs = [{"role": "user", "content": PROMPTS[i % 5]}, {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": f"and case {i}?"}]
                stream = self.oai.chat.completions.create(model=self.model, max_tokens=16, stream=True, messages=msgs)
                return "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
            return self.oai.completions.create(model=self.model, prompt=f"{PROMPTS[i % 5]}  # {i}",
                                               max_tokens=16).choices[0].text
        except Exception as e:  # a failed request is counted, not raised
            return e

    def message(self, i: int):
        try:
            msgs = [{"role": "user", "content": f"{PROMPTS[i % 5]} (message {i})"}]
            if i % 2 == 0:
                with self.claude.messages.stream(model=self.model, max_tokens=16, messages=msgs) as s:
                    return "".join(s.text_stream)
            return self.claude.messages.create(model=self.model, max_tokens=16, messages=msgs).content[0].text
        except Exception as e:
            return e


def start(port: int, flags: list[str]):
    """The server subprocess once it listens, and its log (read on a thread from then on: never blocks it)."""
    proc = subprocess.Popen([sys.executable, "-m", "edge0.cli", "serve", "--port", str(port), *flags],
                            stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    for line in proc.stderr:
        log.append(line)
        if "serving" in line:
            break
    drain = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
    drain.start()
    return proc, log, drain


class Rss:
    """The server's RSS every 0.2 s, each sample with the requests answered by then."""

    def __init__(self, pid: int):
        self.pid, self.answered, self.samples = pid, 0, []
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.done.wait(0.2):
            self.samples.append((self.answered, rss_mib(self.pid)))

    def phase(self, answered: int) -> float:
        self.answered = answered
        self.samples.append((answered, rss_mib(self.pid)))
        return self.samples[-1][1]

    def since(self, answered: int) -> tuple[float, float]:
        """(RSS when `answered` requests were answered, the highest RSS from then on)."""
        after = [r for n, r in self.samples if n >= answered]
        return after[0], max(after)


def soak(load: Load, rss: Rss, cycles: int) -> int:
    """The phases, RSS after each; returns the failed requests."""
    n = failures = 0
    for cycle in range(cycles):
        for name, fn, count, workers in (("sequential", load.ask, 100, 1), ("concurrent 8x10", load.ask, 80, 8),
                                         ("/v1/messages 8x5", load.message, 40, 8)):
            with ThreadPoolExecutor(workers) as pool:
                results = list(pool.map(fn, range(n, n + count)))
            n += count
            failed = [r for r in results if isinstance(r, Exception)]
            failures += len(failed)
            print(f"cycle {cycle + 1} {name:17} {n:5} requests  {len(failed)} failed  RSS {rss.phase(n):7.1f} MiB"
                  + (f"  (first failure: {failed[0]!r})" if failed else ""), flush=True)
    return failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=9, help="cycles of 220 requests (default 9)")
    p.add_argument("--rss-limit", type=float, default=1.2, help="most RSS over its level at --baseline-after")
    p.add_argument("--baseline-after", type=int, default=100, metavar="N",
                   help="the RSS limit is relative to the RSS after N requests (default 100: the first phase)")
    p.add_argument("--port", type=int, default=8931)
    ours, flags = p.parse_known_args()
    if not any(f.startswith("--prompt-cache-gib") for f in flags):
        flags += ["--prompt-cache-gib", CACHE_GIB]
    proc, log, drain = start(ours.port, flags)
    if proc.poll() is not None:
        print("".join(log), end="")
        return 1
    t0, rss = time.time(), Rss(proc.pid)
    try:
        failures = soak(Load(ours.port), rss, ours.cycles)
    finally:
        rss.done.set()
        proc.terminate()
        proc.wait(timeout=120)
        drain.join(timeout=10)
    text = "".join(log)
    print(f"{220 * ours.cycles} requests in {time.time() - t0:.0f} s: {failures} failed; tracebacks in the log: "
          f"{text.count('Traceback')}; exit {proc.returncode}; last RSS {rss.samples[-1][1]:.1f} MiB")
    over = False
    for after in sorted({ours.baseline_after, 220}):
        base, top = rss.since(after)
        verdict = ""
        if after == ours.baseline_after:
            over = top > ours.rss_limit * base
            verdict = f": {'FAIL' if over else 'pass'} (limit {ours.rss_limit}x)"
        print(f"RSS after {after} requests {base:.1f} MiB, highest from then on {top:.1f} MiB ({top / base:.3f}x)"
              + verdict)
    return int(bool(failures) or "Traceback" in text or over)


if __name__ == "__main__":
    sys.exit(main())
