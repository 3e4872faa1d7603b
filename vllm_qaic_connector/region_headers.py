"""Transfer tickets: proof that a staged region still holds what a decode was told it holds.

Every staged region starts with a small header that repeats the region's generation and
binds what its ticket names (`ticket.ticket_binding`: tokens, blocks, format), so a ticket
edited to name other blocks or more tokens is refused by the header itself. The prefill
hands the generation out in ``kv_transfer_params`` (with its incarnation and a hash of the
prompt's token ids). The writer zeroes a region's header before anything overwrites
its bytes (reuse) or when it is given up (release, lease expiry); a reader checks the header
before and after its copy, seqlock style. So a read that raced a reuse, or came after the
region was given up, is detected and becomes a load error, never wrong tokens.

Saves run off the engine's step, so a ticket can reach a decode before its region is
written. The engine thread promises the generation in the header (a third word) when it
hands the save over; a reader that finds the promise waits, bounded, for the seal.
"""

from __future__ import annotations

import bisect
import itertools
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from vllm_qaic_connector.protocol.ticket import UNBOUND
from vllm_qaic_connector.protocol.wire import TransportEndpoint

if TYPE_CHECKING:  # any transport: the scheduler half imports this module too
    from vllm_qaic_connector.transports.base import KVTransport

HEADER_BYTES = 64  # keeps the KV after it cache-line aligned
MAGIC = 0x3130564B43494151  # b"QAICKV01", little-endian
SEAL_WAIT_S = 10.0  # how long a reader waits for a promised region to be sealed


class StaleTicket(ConnectionError):
    """The staged region does not hold the ticket's KV (reused, released or expired; or
    the ticket was edited)."""


def new_incarnation() -> str:
    """Names one engine start; unguessable, so segment names derived from it are too."""
    return secrets.token_hex(8)


def generations() -> Iterator[int]:
    """Unique, non-zero generations; a random base keeps them unique across restarts too."""
    return itertools.count(((secrets.randbits(30) + 1) << 32) + 1)


def _words(header: torch.Tensor) -> torch.Tensor:
    return header[:24].view(torch.int64)  # magic, generation, promised generation


def header_generation(header: torch.Tensor) -> int:
    """The generation a region's header holds; 0 if it holds none."""
    magic, generation, _ = (int(w) for w in _words(header).tolist())
    return generation if magic == MAGIC else 0


def header_binding(header: torch.Tensor) -> bytes:
    """What a sealed region's header binds (`ticket.ticket_binding`)."""
    return bytes(header[24 : 24 + len(UNBOUND)].tolist())


def promised_generation(header: torch.Tensor) -> int:
    """The generation a save in flight will seal the region with; 0 if none."""
    return int(_words(header)[2])


def seal(header: torch.Tensor, generation: int, binding: bytes = UNBOUND) -> None:
    """Writes the header; a final seal (generation set) also fulfils the promise and
    writes the ``binding`` first, while an unsealing one leaves the promise word alone (the
    engine thread may be writing it)."""
    if generation:
        header[24 : 24 + len(UNBOUND)].copy_(torch.tensor(list(binding), dtype=torch.uint8))
    words = [MAGIC, generation, 0] if generation else [MAGIC, 0]
    _words(header)[: len(words)].copy_(torch.tensor(words, dtype=torch.int64))


class RegionHeaders:
    """The writer's side: which staged regions hold a live header, so that any write into a
    region's bytes first invalidates its header. The engine thread invalidates and promises
    while the save thread writes, hence the lock."""

    def __init__(self, staging: torch.Tensor) -> None:
        self._staging = staging
        self._starts: list[int] = []  # sorted starts of live regions
        self._ends: dict[int, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def writing(
        self, start: int, end: int, generation: int, binding: bytes = UNBOUND
    ) -> Iterator[torch.Tensor]:
        """Yields the region's KV bytes ``[start + HEADER_BYTES, end)``; sealed with
        ``binding`` on success (generation 0: a part of the region, left unsealed until its
        last part)."""
        header = self._staging[start : start + HEADER_BYTES]
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            if i > 0 and self._ends[self._starts[i - 1]] > start:
                i -= 1
            while i < len(self._starts) and self._starts[i] < end:
                self._invalidate(self._starts[i])
            seal(header, 0)  # a header from an earlier, shifted region may lie inside
        yield self._staging[start + HEADER_BYTES : end]
        if generation:
            with self._lock:
                seal(header, generation, binding)
                bisect.insort(self._starts, start)
                self._ends[start] = end

    def invalidate(self, start: int) -> None:
        with self._lock:
            self._invalidate(start)

    def _invalidate(self, start: int) -> None:
        if self._ends.pop(start, None) is not None:
            self._starts.remove(start)
            self.abandon(start)

    def promise(self, start: int, generation: int) -> None:
        """Readers of ``generation`` at ``start`` wait for its seal (the save is queued).
        Touches only the promise word, so the engine thread may call it while the save
        thread writes other regions."""
        _words(self._staging[start : start + HEADER_BYTES])[2] = generation

    def abandon(self, start: int) -> None:
        """No live KV and no promise: readers fail at once."""
        _words(self._staging[start : start + HEADER_BYTES]).zero_()


@contextmanager
def checked_read(
    transport: KVTransport,
    peer: TransportEndpoint,
    offset: int,
    nbytes: int,
    generation: int,
    notify: bytes | None = None,
    binding: bytes = UNBOUND,
) -> Iterator[torch.Tensor]:
    """Yields a staged region's KV bytes; raises StaleTicket if the header did not hold
    ``generation`` both before the read and after the caller's copy, or binds other than
    ``binding`` (the ticket's `ticket.ticket_binding`). ``notify`` travels
    with the final header read, so the prefill frees the region only after both checks.
    ``nbytes`` 0 reads the header alone, for a caller that moves the bytes itself (a READ
    straight into its own memory): it is checked before and after the body of the ``with``."""
    region = transport.read(peer, offset, HEADER_BYTES + nbytes)
    if header_generation(region[:HEADER_BYTES]) != generation:
        transport.release_read(peer, offset)
        _await_seal(transport, peer, offset, generation)
        region = transport.read(peer, offset, HEADER_BYTES + nbytes)
    try:
        _expect(header_generation(region[:HEADER_BYTES]), generation, "before the copy")
        if header_binding(region[:HEADER_BYTES]) != binding:
            raise StaleTicket(
                "the staged region was sealed for other tokens, blocks or format than the "
                "ticket names: the kv_transfer_params were edited"
            )
        yield region[HEADER_BYTES:]
    finally:
        transport.release_read(peer, offset)
    _expect(_read_header(transport, peer, offset, notify)[0], generation, "after the copy")


def _read_header(
    transport: KVTransport, peer: TransportEndpoint, offset: int, notify: bytes | None = None
) -> tuple[int, int]:
    """The generation and the promised generation a region's header holds now."""
    header = transport.read(peer, offset, HEADER_BYTES, notify=notify)
    try:
        return header_generation(header), promised_generation(header)
    finally:
        transport.release_read(peer, offset)


def _await_seal(
    transport: KVTransport, peer: TransportEndpoint, offset: int, generation: int
) -> None:
    """Returns once the header holds ``generation``; waits while a save promised it."""
    deadline, pause = time.monotonic() + SEAL_WAIT_S, 0.0005
    while True:
        found, promised = _read_header(transport, peer, offset)
        if found == generation or found != 0 or promised != generation:
            _expect(found, generation, "before the copy")
            return
        if time.monotonic() > deadline:
            raise StaleTicket(
                f"staged region promised generation {generation} but was not written "
                f"within {SEAL_WAIT_S:.0f}s"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _expect(found: int, generation: int, when: str) -> None:
    if found != generation:
        state = "no live KV" if found == 0 else f"generation {found}"
        raise StaleTicket(
            f"staged region holds {state} {when}, ticket says {generation}: it was reused, "
            "released or its lease expired"
        )
