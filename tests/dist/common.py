"""Helpers of the distributed tests: mlx.launch's command on free ports."""

import socket
import sys
from pathlib import Path

HERE = Path(__file__).parent
LAUNCH = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]  # mlx.launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_cmd(script: str, *args: str, env: dict | None = None, ranks: int = 2) -> list[str]:
    """`mlx.launch -n RANKS --backend ring` of tests/dist/SCRIPT on free ports; extra env for every rank."""
    cmd = [*LAUNCH, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_port())]
    for k, v in (env or {}).items():
        cmd += ["--env", f"{k}={v}"]
    return [*cmd, "--", sys.executable, str(HERE / script), *args]
