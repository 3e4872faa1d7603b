"""Free TCP ports for the servers a test starts, chosen outside the kernel's ephemeral range.

A port taken from ``bind(("", 0))`` is ephemeral: between our pick and the server's bind, vLLM
(which binds its own zmq ports to 0) or any outgoing connection may be handed the same number, and
the server then dies with ``Address already in use``. Ports below the ephemeral range are only
ever given out by explicit choice, so a random free one there stays ours.

    python -m testbed.ports 3    # prints three distinct free ports, one per line
"""

from __future__ import annotations

import random
import socket
import sys

RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_given: set[int] = set()


def _below_ephemeral() -> range:
    try:
        with open(RANGE_FILE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), low)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port no one listens on now, never one this process handed out before."""
    candidates = _below_ephemeral()
    for _ in range(200):
        port = random.choice(candidates)
        if port not in _given and _is_free(port):
            _given.add(port)
            return port
    raise RuntimeError(f"no free port in {candidates.start}-{candidates.stop - 1}")


if __name__ == "__main__":
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
        print(free_port())
