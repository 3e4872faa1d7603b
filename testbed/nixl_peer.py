"""A NIXL transport in its own process, for tests/integration/test_nixl_transport.py;
`Peer` is the parent's handle on one.

``owner``: creates a NixlTransport, fills its staging with `pattern(seed, size)`, prints
``ENDPOINT <msgpack hex>``, then serves commands on stdin: ``NOTIFS`` prints ``NOTIFS <json list
of hex messages>``; ``CLOSE`` (or EOF) closes twice and prints ``CLOSED <registrations>
<remote agents>``.

``reader <endpoint hex>``: reads `RANGES` from that owner, compares them with the pattern, reads
once more with ``notify=b"req-1"``, closes, and prints ``RESULT <json>``; exit status 1 on a
mismatch. Used where the reader must run in another network namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time

import msgspec
import torch

from vllm_qaic_connector.protocol.wire import TransportEndpoint
from vllm_qaic_connector.transports.nixl import NixlTransport

SIZE = (12 << 20) + 4099  # odd, so the last range ends off any alignment
SEED = 1234
# offset 0, unaligned offsets and lengths, the very end, and 8 MiB from an odd offset
RANGES = [(0, 4096), (1, 1), (13, 1000), (4097, 65537), (SIZE - 777, 777), (12345, 8 << 20)]


PEER_SCRIPT = os.path.abspath(__file__)  # run by path: it imports only the package
ROOT = os.path.dirname(os.path.dirname(PEER_SCRIPT))


class Peer:
    """A nixl_peer.py child, spoken to line by line over its stdin/stdout."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # nixl's logs, kept for failure messages
            text=True,
            env={**os.environ, **(env or {})},
            cwd=ROOT,  # where `-m testbed...` finds the testbed
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line.startswith(prefix + " "):
                return line[len(prefix) + 1 :]
        raise AssertionError(f"no {prefix!r} line from peer; its output:\n{''.join(self.log)}")

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def notifications(self) -> list[bytes]:
        self.send("NOTIFS")
        return [bytes.fromhex(m) for m in json.loads(self.expect("NOTIFS"))]

    def wait_for_notification(self, msg: bytes, timeout: float = 15.0) -> list[bytes]:
        seen: list[bytes] = []
        deadline = time.monotonic() + timeout
        while msg not in seen and time.monotonic() < deadline:
            seen += self.notifications()
            time.sleep(0.05)
        return seen

    def close(self) -> str:
        self.send("CLOSE")
        closed = self.expect("CLOSED")
        assert self.proc.wait(30) == 0
        return closed

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def pattern(seed: int, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)


def encode(endpoint: TransportEndpoint) -> str:
    return msgspec.msgpack.encode(endpoint).hex()


def decode(text: str) -> TransportEndpoint:
    return msgspec.msgpack.decode(bytes.fromhex(text), type=TransportEndpoint)


def owner(name: str, size: int, seed: int) -> int:
    transport = NixlTransport(name, size)
    transport.staging.copy_(pattern(seed, size))
    print("ENDPOINT", encode(transport.endpoint()), flush=True)
    for line in sys.stdin:
        if line.strip() == "NOTIFS":
            msgs = [m.hex() for m in transport.poll_notifications()]
            print("NOTIFS", json.dumps(msgs), flush=True)
        elif line.strip() == "CLOSE":
            break
    transport.close()
    transport.close()  # idempotent
    print("CLOSED", transport.registrations, len(transport.remote_agents), flush=True)
    return 0


def reader(name: str, endpoint: TransportEndpoint, seed: int) -> int:
    want = pattern(seed, endpoint.size)
    transport = NixlTransport(name, 1 << 20, timeout_s=30.0)
    mismatches: list[list[int]] = []
    try:
        for offset, nbytes in RANGES:
            got = transport.read(endpoint, offset, nbytes)
            if not torch.equal(got, want[offset : offset + nbytes]):
                mismatches.append([offset, nbytes])
            transport.release_read(endpoint, offset)
        got = transport.read(endpoint, 64, 64, notify=b"req-1")
        notify_read_ok = torch.equal(got, want[64:128])
        transport.release_read(endpoint, 64)
    finally:
        transport.close()
    result = {
        "mismatches": mismatches,
        "bytes": sum(n for _, n in RANGES),
        "notify_read_ok": notify_read_ok,
        "registrations_after_close": transport.registrations,
    }
    print("RESULT", json.dumps(result), flush=True)
    return 0 if not mismatches and notify_read_ok else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["owner", "reader"])
    parser.add_argument("endpoint", nargs="?", help="reader: the owner's ENDPOINT hex")
    parser.add_argument("--name", default=f"qaic_nixl_peer_{os.getpid()}")
    parser.add_argument("--size", type=int, default=SIZE)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    if args.role == "owner":
        return owner(args.name, args.size, args.seed)
    return reader(args.name, decode(args.endpoint), args.seed)


if __name__ == "__main__":
    sys.exit(main())
