"""`edge0 serve` over two local ranks: rank 0 answers as one process would; stopping rank 0 ends every rank; a rank
that leaves mid-generation fails the request, /health says so, and the service stops (no hang)."""

import json
import os
import signal
import subprocess
import sys
import time

from tests.helpers import http_request

from .common import HERE, free_port, launch_cmd

PROMPT = "hello world, the"  # tests/dist/ranks.py's


def start(store, port: int, env: dict | None = None, cli: bool = False) -> tuple[subprocess.Popen, str]:
    """The ranks of tests/dist/serve_ranks.py, or (cli) of `edge0 launch -n 2 -- serve`; (launcher, rank 0's URL)."""
    if cli:
        cmd = [sys.executable, "-m", "edge0.cli", "launch", "-n", "2", "--port", str(free_port()), "--", "serve",
               "--model", str(store), "--port", str(port), "--routing", "predicted", "--executor", "staged",
               "--lora", "none"]
    else:
        cmd = launch_cmd("serve_ranks.py", str(store), "predicted", str(port), env=env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "EDGE0_KERNEL": "mlx"})
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if line.startswith("listening") or " on http://" in line:
            return proc, (line.split()[1] if line.startswith("listening") else line.split(" on ")[1].split("/v1")[0])
        assert time.monotonic() < deadline, "no server after 60 s"
    raise AssertionError(f"the ranks ended before listening (rc {proc.wait()})")


def end(proc: subprocess.Popen) -> None:
    """The launcher and its ranks (its session), if still there."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def rank0(proc: subprocess.Popen) -> int:
    """The pid of rank 0 among the launcher's children."""
    for _ in range(50):
        out = subprocess.run(["pgrep", "-f", "serve"], capture_output=True, text=True).stdout
        for pid in out.split():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if b"MLX_RANK=0\0" in env and os.getsid(int(pid)) == proc.pid:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError("no rank 0")


def completion(url: str, max_tokens: int = 16) -> tuple[int, dict]:
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}).encode()
    status, answer, _ = http_request(url, "POST", "/v1/completions", body)
    return status, answer


def test_served_text_is_one_process_text_and_stop_ends_every_rank(dist_store):
    """`edge0 launch -n 2 -- serve` as a user starts it."""
    one = subprocess.run([sys.executable, str(HERE / "ranks.py"), str(dist_store), "predicted:staged"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "EDGE0_KERNEL": "mlx"})
    want = json.loads(one.stdout.splitlines()[-1])["text"]
    proc, url = start(dist_store, free_port(), cli=True)
    try:
        status, answer = completion(url)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == want
        os.kill(rank0(proc), signal.SIGINT)
        out, _ = proc.communicate(timeout=30)  # every rank ends: rank 1 was told to stop
        assert proc.returncode == 0 and "shutting down" in out, out
        assert "exited with code" not in out and "was killed" not in out, out
    finally:
        end(proc)


def test_lost_rank_fails_the_request_and_stops_the_service(dist_store):
    proc, url = start(dist_store, free_port(), env={"EDGE0_TEST_DIE_RANK": "1", "EDGE0_TEST_DIE_AFTER": "3"})
    try:
        status, answer = completion(url)
        assert status == 500, answer
        status, health = http_request(url, "GET", "/health")[:2]
        assert status == 503 and "unhealthy" in json.dumps(health), health
        out, _ = proc.communicate(timeout=30)  # the service stops by itself
        assert "another rank stopped or failed" in out, out
    finally:
        end(proc)


def test_hung_rank_stops_the_service(dist_store):
    """Rank 1 stops answering (alive, asleep) mid-generation: rank 0's watchdog stops the service, nothing hangs."""
    proc, url = start(dist_store, free_port(), env={"EDGE0_TEST_DIE_RANK": "1", "EDGE0_TEST_DIE_AFTER": "3",
                                                    "EDGE0_TEST_HANG": "1", "EDGE0_RANK_TIMEOUT_S": "2"})
    try:
        try:
            status, answer = completion(url)
        except OSError:  # the connection closed as the server stopped
            status, answer = None, None
        assert status != 200, answer
        out, _ = proc.communicate(timeout=40)
        assert "no token for 2 s: a rank is not answering" in out, out
    finally:
        end(proc)


def test_rank_lost_while_idle_shows_on_health(dist_store):
    """Rank 1 leaves after the first request, while nothing generates: /health says so within seconds, with no
    request to find it, and the service stops by itself."""
    proc, url = start(dist_store, free_port(), env={"EDGE0_TEST_LEAVE_IDLE": "1"})
    try:
        status, answer = completion(url)
        assert status == 200, answer
        health, deadline = None, time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                status, health = http_request(url, "GET", "/health")[:2]
            except OSError:  # stopped already: too late to read it
                break
            if status != 200:
                break
            time.sleep(0.05)
        assert status == 503 and "rank 1 stopped or disconnected" in json.dumps(health), (status, health)
        out, _ = proc.communicate(timeout=30)
        assert "rank 1 stopped or disconnected; the service stops" in out, out
    finally:
        end(proc)
