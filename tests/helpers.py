"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path

_tokens: list = []  # kernels made current by use_kernel, undone after each test (conftest)


def use_kernel(name: str):
    """Make `name` the current kernel for the rest of the test; returns the Kernel."""
    from edge0.compute.kernel_choice import Kernel, _active

    k = Kernel.choose(name)
    _tokens.append(_active.set(k))
    return k


def undo_kernels() -> None:
    from edge0.compute.kernel_choice import _active

    while _tokens:
        _active.reset(_tokens.pop())


def run_json(*argv: str, env: dict | None = None, timeout: float = 600) -> dict:
    """`python -m edge0.run ARGV --json` in its own process: its one JSON object (exit 0 asserted)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "edge0.run", *argv, "--json"], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def http_request(url: str, method: str, path: str, body: bytes | None = None,
                 content_type: str = "application/json", timeout: float = 60) -> tuple[int, dict | str, dict]:
    """(status, JSON body or text, headers) of one request with urllib (no client library in the way)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, data=body, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text, headers = r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, text, headers = e.code, e.read().decode(), dict(e.headers)
    try:
        return status, json.loads(text), headers
    except ValueError:
        return status, text, headers


def metric(url: str, name: str) -> float:
    """One figure of a server's /metrics (edge0_NAME)."""
    text = http_request(url, "GET", "/metrics")[1]
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"edge0_{name} ")))


OLMOE_TRACES = Path(__file__).parent / "data" / "olmoe"  # real OLMoE-1B-7B routing, seeds 1-3 (its README)
