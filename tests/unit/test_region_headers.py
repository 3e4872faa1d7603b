"""Tickets over real POSIX shared memory: a read of a reused, released or racing region is
detected, never returned as the old request's KV."""

from __future__ import annotations

import os
import random

import pytest
import torch

from vllm_qaic_connector.region_headers import (
    HEADER_BYTES,
    RegionHeaders,
    StaleTicket,
    checked_read,
    header_generation,
)
from vllm_qaic_connector.transports.shm import ShmTransport

PAGE, PAGES = 4096, 16


@pytest.fixture
def pair():
    tag = f"qaic_kv_tk{os.getpid()}_{random.randrange(1 << 30):x}"
    owner, reader = ShmTransport(f"{tag}o_r0_a", PAGE * PAGES), ShmTransport(f"{tag}r_r0_b", 64)
    yield owner, reader, RegionHeaders(owner.staging)
    reader.close()
    owner.close()


def stage(headers: RegionHeaders, start: int, pages: int, generation: int) -> int:
    """Writes a region of ``pages`` pages whose bytes all equal ``generation % 251``."""
    end = start + pages * PAGE
    with headers.writing(start, end, generation) as kv:
        kv.fill_(generation % 251)
    return end - start - HEADER_BYTES


def read(owner, reader, start: int, nbytes: int, generation: int) -> torch.Tensor:
    with checked_read(reader, owner.endpoint(), start, nbytes, generation) as kv:
        return kv.clone()


def test_live_region_reads_back(pair):
    owner, reader, headers = pair
    n = stage(headers, 2 * PAGE, 3, 77)
    assert torch.all(read(owner, reader, 2 * PAGE, n, 77) == 77)
    with pytest.raises(StaleTicket, match="generation 77 before"):
        read(owner, reader, 2 * PAGE, n, 78)


def test_reuse_that_spares_the_old_header_is_still_detected(pair):
    """B overlaps only A's tail, so A's header bytes are not overwritten by B's KV: the
    writer must invalidate A's header itself."""
    owner, reader, headers = pair
    n = stage(headers, 0, 4, 10)
    stage(headers, 2 * PAGE, 4, 11)
    assert header_generation(owner.staging[:HEADER_BYTES]) == 0
    with pytest.raises(StaleTicket, match="no live KV"):
        read(owner, reader, 0, n, 10)


def test_release_invalidates(pair):
    owner, reader, headers = pair
    n = stage(headers, PAGE, 2, 5)
    headers.invalidate(PAGE)
    with pytest.raises(StaleTicket):
        read(owner, reader, PAGE, n, 5)


def test_reuse_racing_the_copy_is_detected_after_it(pair):
    """The header was right when the read began; the region is reused while the reader
    copies. The check after the copy catches it."""
    owner, reader, headers = pair
    n = stage(headers, 0, 4, 20)
    with (
        pytest.raises(StaleTicket, match="after the copy"),
        checked_read(reader, owner.endpoint(), 0, n, 20) as kv,
    ):
        first_half = kv[: n // 2].clone()
        stage(headers, PAGE, 2, 21)  # reuse lands in the middle of the copy
        kv[n // 2 :].clone()
    assert torch.all(first_half == 20)


def test_no_live_header_ever_covers_overwritten_bytes(pair):
    """Random reuse: every region whose header still holds its generation reads back
    exactly its own bytes; every other one is refused."""
    owner, reader, headers = pair
    rng = random.Random(0)
    written: dict[int, tuple[int, int]] = {}  # generation -> (start, kv bytes)
    live = 0
    for generation in range(100, 400):
        pages = rng.randint(1, 5)
        start = rng.randint(0, PAGES - pages) * PAGE
        written[generation] = (start, stage(headers, start, pages, generation))
        if rng.random() < 0.1:
            headers.invalidate(rng.choice([s for s, _ in written.values()]))
        if generation % 10:
            continue
        for gen, (s, n) in written.items():
            try:
                kv = read(owner, reader, s, n, gen)
            except StaleTicket:
                continue
            live += 1
            assert torch.all(kv == gen % 251), f"generation {gen} read stale bytes"
    assert live >= 30  # the test exercised live regions, not only refusals
