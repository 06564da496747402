"""dist/lifeline.py: rank 0's listener at start, over real sockets."""

import socket
import threading

from edge0.dist.lifeline import Lifeline


class _Group:
    def size(self) -> int:
        return 2


def test_a_stray_connection_is_not_a_rank_and_stops_nothing():
    """A connection whose greeting is not '<rank> <number>' is closed and rank 1's lifeline still holds (it was a
    ValueError out of rank 0's start)."""
    line = Lifeline.__new__(Lifeline)
    lost = threading.Event()
    line.group, line.rank, line.stopping, line.lost = _Group(), 0, False, lambda rank: rank == 1 and lost.set()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stray = socket.create_connection(("127.0.0.1", port))
    stray.sendall(b"GET /\n")
    rank1 = socket.create_connection(("127.0.0.1", port))
    rank1.sendall(b"1 42\n")
    line._accept(server, 42)
    assert stray.recv(8) == b""  # closed by rank 0
    assert not lost.is_set()
    rank1.close()
    assert lost.wait(5)  # its end is noticed: it was rank 1's lifeline
    stray.close()
