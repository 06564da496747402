"""A served pipeline's lifeline: each rank > 0 holds one TCP connection to rank 0 for as long as it runs, so rank 0
learns at once, even while idle, that a rank's process ended or its host went away (the OS closes the socket); the
ranks' collectives would say so only at the next request.

Rank 0 listens on a port of every interface; the port and a number drawn on rank 0 go to the other ranks with one
all_sum; each connects to rank 0's address (mlx.launch's MLX_HOSTFILE or MLX_JACCL_COORDINATOR) and sends its rank
and that number. A rank that cannot connect within CONNECT_S is logged; the service runs without its lifeline.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time

import mlx.core as mx

from ..log import log

CONNECT_S = 30.0  # how long rank 0 waits for the other ranks' connections at start


class Lifeline:
    """Rank 0's side: `lost(rank)` is called on a watcher thread when rank's connection ends (not after stop())."""

    def __init__(self, group, lost=None):
        self.group, self.rank, self.lost = group, group.rank(), lost
        self.stopping = False
        self.sock = None  # a rank > 0's connection (kept open until the process ends)
        nonce = int.from_bytes(os.urandom(4), "little") >> 2
        server = None
        if self.rank == 0:
            server = socket.create_server(("", 0))
            port = server.getsockname()[1]
        shared = mx.array([port, nonce] if self.rank == 0 else [0, 0], dtype=mx.int64)
        port, nonce = mx.distributed.all_sum(shared, group=group, stream=mx.cpu).tolist()
        if self.rank == 0:
            self._accept(server, nonce)
        else:
            self._connect(port, nonce)

    def stop(self) -> None:
        """Rank 0 is about to tell the others to stop: their connections ending is no loss."""
        self.stopping = True

    def _connect(self, port: int, nonce: int) -> None:
        host = rank0_host()
        try:
            self.sock = socket.create_connection((host, port), timeout=CONNECT_S)
            self.sock.sendall(f"{self.rank} {nonce}\n".encode())
        except OSError as e:
            log.warning(f"pipeline: no lifeline to rank 0 at {host}:{port} ({e}); a rank lost while idle is noticed "
                        "at the next request")

    def _accept(self, server: socket.socket, nonce: int) -> None:
        peers: dict[socket.socket, int] = {}
        deadline = time.monotonic() + CONNECT_S
        with server:
            while len(peers) < self.group.size() - 1 and (left := deadline - time.monotonic()) > 0:
                server.settimeout(left)
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                try:
                    conn.settimeout(left)
                    rank, got = map(int, conn.makefile("r").readline().split())
                except (OSError, ValueError):  # not a rank's greeting (a stray connection): not one of ours
                    rank, got = -1, -1
                if got == nonce and 0 < rank < self.group.size():
                    peers[conn] = rank
                else:
                    conn.close()
        missing = sorted(set(range(1, self.group.size())) - set(peers.values()))
        if missing:
            log.warning(f"pipeline: no lifeline from rank(s) {missing}; a rank lost while idle is noticed at the next "
                        "request")
        for conn in peers:
            conn.settimeout(None)
        if peers:
            threading.Thread(target=self._watch, args=(peers,), name="edge0-lifeline", daemon=True).start()

    def _watch(self, peers: dict) -> None:
        while peers:
            ready, _, _ = select.select(list(peers), [], [])
            for conn in ready:
                try:
                    data = conn.recv(64)
                except OSError:
                    data = b""
                if data:
                    continue  # nothing is sent after the greeting; ignored
                rank = peers.pop(conn)
                conn.close()
                if not self.stopping and self.lost is not None:
                    self.lost(rank)


def rank0_host() -> str:
    """Rank 0's address as mlx.launch gave it: the ring's first host, the JACCL coordinator, else this machine."""
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            return json.load(f)[0][0].rsplit(":", 1)[0]
    except (KeyError, OSError, ValueError, IndexError, TypeError, AttributeError):
        return "127.0.0.1"
