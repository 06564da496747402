"""`edge0 launch`: an edge0 command on several ranks with mlx.launch, the model's layers split across them
(pipeline parallel, edge0/dist).

    edge0 launch -n 2 -- run --prompt "def fib(n):"
    edge0 launch --hostfile hosts.json -- serve --model ~/stores/big --host 0.0.0.0 --api-key KEY
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

LAUNCHER = "from mlx._distributed_utils.launch import main; main()"  # mlx.launch, whatever its script's path
COMMANDS = ("run", "serve")  # the commands that run across ranks


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--local-ranks", type=int, default=None, metavar="N",
                   help="N ranks on this machine (ring backend over 127.0.0.1)")
    p.add_argument("--hostfile", default=None, metavar="FILE",
                   help="mlx.launch's host file: one entry per rank, {\"ssh\": NAME, \"ips\": [IP]}, for ranks on "
                        "several machines (each with edge0 at this Python's path and the store at --model's path)")
    p.add_argument("--backend", default=None, choices=("ring", "jaccl", "jaccl-ring"),
                   help="MLX's distributed backend: ring (TCP) or jaccl (Thunderbolt RDMA) (default: the host file's, "
                        "else ring)")
    p.add_argument("--parallel", default="pipeline", choices=("pipeline", "experts"),
                   help="pipeline: each rank runs a contiguous range of layers; experts: each rank runs every layer "
                        "with a share of its experts (--routing native), one all_sum per MoE layer (default pipeline)")
    p.add_argument("--split", default="even", metavar="even|cost|N,N,...",
                   help="pipeline: each rank's layers: an even count, counts, or by cost: a rank's cost is the larger of "
                        "its share of the bytes held (its layers' resident weights and experts in the store, the "
                        "embedding on the first rank, norm and head on the last) and its share of the expert bytes "
                        "a decode step reads, measured per layer by a 32-token greedy decode of a fixed prompt over an "
                        "even split before the real one (one more load); the largest rank's cost least (default "
                        "even)")
    p.add_argument("--rank-timeout", type=float, default=None, metavar="S",
                   help="serve: a generation with no token for S seconds means a rank hangs: the service stops "
                        "(default 300)")
    p.add_argument("--port", type=int, default=None,
                   help="the ring's first port, one more per rank (default mlx.launch's, 32323)")
    p.add_argument("ranked", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help=f"the edge0 command ({' or '.join(COMMANDS)}) and its flags")


def main(args: argparse.Namespace) -> int:
    from ..dist import MODE_ENV
    from ..dist.hosts import read_hostfile
    from ..dist.serve import TIMEOUT_ENV
    from ..dist.split import SPLIT_ENV, check_split
    from ..errors import Edge0Error

    command = args.ranked[1:] if args.ranked[:1] == ["--"] else args.ranked
    if not command or command[0] not in COMMANDS:
        raise Edge0Error(f"edge0 launch: name the command to run across ranks after --: {' or '.join(COMMANDS)}")
    from . import build_parser

    build_parser().parse_args(command)  # a bad flag is said here once, not by every rank
    if (args.local_ranks is None) == (args.hostfile is None):
        raise Edge0Error("edge0 launch: give -n N (ranks on this machine) or --hostfile FILE, one of them")
    if args.local_ranks is not None and not 2 <= args.local_ranks <= 64:
        raise Edge0Error(f"-n {args.local_ranks}: from 2 to 64 ranks")
    if args.hostfile is not None and not Path(args.hostfile).is_file():
        raise Edge0Error(f"--hostfile {args.hostfile}: no such file")
    ranks = args.local_ranks if args.hostfile is None else read_hostfile(args.hostfile, args.backend)
    if args.parallel == "pipeline":
        check_split(args.split, ranks, _model(command[1:]))
    elif args.split != "even":  # expert parallel splits the experts (id % ranks), every rank holds every layer
        raise Edge0Error(f"--split {args.split}: splits layers, for --parallel pipeline only")
    if args.rank_timeout is not None and not 0 < args.rank_timeout <= 86400:
        raise Edge0Error(f"--rank-timeout {args.rank_timeout:g}: seconds, more than 0 and at most 86400")
    if args.port is not None and not 1024 <= args.port <= 65000:
        raise Edge0Error(f"--port {args.port}: from 1024 to 65000")
    where = ["-n", str(args.local_ranks)] if args.local_ranks is not None else ["--hostfile", args.hostfile]
    port = ["--starting-port", str(args.port)] if args.port is not None else []
    timeout = ["--env", f"{TIMEOUT_ENV}={args.rank_timeout:g}"] if args.rank_timeout is not None else []
    backend = ["--backend", args.backend] if args.backend else [] if args.hostfile else ["--backend", "ring"]
    cmd = [sys.executable, "-c", LAUNCHER, *where, *backend, *port,
           "--env", f"{MODE_ENV}={args.parallel}", "--env", f"{SPLIT_ENV}={args.split}",
           *timeout, "--",
           sys.executable, "-m", "edge0.cli", *command]
    return run_ranks(cmd)


def _model(argv: list[str]) -> str | None:
    """The ranked command's --model (None: the built-in model's)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    return p.parse_known_args(argv)[0].model


SSH_FAILED = "edge0: error: a rank exited with code 255: ssh's own when a --hostfile host cannot be reached or logged into\n"


def run_ranks(cmd: list[str]) -> int:
    """Run mlx.launch, its stdout as it comes; 1 when a rank failed (mlx.launch itself exits 0 then). An error every
    rank reports alike is said once; after one, mlx.launch's lines on the ranks' exits are not repeated. mlx.launch's
    own traceback (its cleanup over ssh of a host it never reached) is left out: a rank's exit 255 says why once."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    failed, said, quiet = False, set(), False
    for line in proc.stderr:
        ended = "Node with rank" in line and ("exited with code" in line or "was killed" in line)
        failed = failed or ended
        if quiet or line.startswith("Exception in thread"):
            quiet = line.startswith(("Exception in thread", "Traceback", " "))  # its last line ends it
            continue
        if ended and "exited with code 255" in line and not said:
            sys.stderr.write(line)
            line = SSH_FAILED
        if line.startswith("edge0: error:"):
            if line in said:
                continue
            said.add(line)
        elif ended and said:
            continue
        sys.stderr.write(line)
    return 1 if proc.wait() or failed else 0
