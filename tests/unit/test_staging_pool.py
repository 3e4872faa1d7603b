"""The staging pool's pages and leases: contiguous runs found in the gaps that releases
leave, and expiry that follows renewals and never misses a deadline."""

from __future__ import annotations

import pytest

from vllm_qaic_connector.scheduler.staging import StagingPool

PAGE = 4096


def test_a_run_goes_into_the_first_gap_that_fits_and_never_across_used_pages() -> None:
    pool = StagingPool(8, PAGE, lease_s=60)
    offsets = [pool.allocate(f"r{i}", PAGE, now=0) for i in range(8)]
    assert offsets == [i * PAGE for i in range(8)]
    assert pool.allocate("full", 1, now=0) is None
    for rid in ("r1", "r2", "r5", "r6", "r7"):
        assert pool.release(rid)
    assert pool.pages_in_use == 3
    # three pages fit only after r4 (pages 5..7), not in the gap of two at pages 1..2
    assert pool.allocate("three", 3 * PAGE, now=0) == 5 * PAGE
    assert pool.allocate("two", 2 * PAGE, now=0) == 1 * PAGE
    assert pool.allocate("one", 1, now=0) is None and pool.pages_in_use == 8
    assert sorted(pool.drain_freed()) == [1 * PAGE, 2 * PAGE, 5 * PAGE, 6 * PAGE, 7 * PAGE]
    with pytest.raises(ValueError, match="more than the whole pool"):
        pool.allocate("huge", 9 * PAGE, now=0)


def test_expiry_follows_each_deadline_and_renewal() -> None:
    pool = StagingPool(4, PAGE, lease_s=10)
    pool.allocate("a", PAGE, now=0)  # ends at 10
    pool.allocate("b", PAGE, now=5)  # ends at 15
    assert pool.renew("a", now=8)  # now ends at 18
    assert pool.expire(now=9.9) == []
    assert pool.expire(now=12) == []  # a's first deadline passed, but it was renewed
    assert pool.expire(now=15) == ["b"]
    pool.allocate("c", PAGE, now=15.5)  # ends at 25.5
    assert pool.expire(now=17.9) == []
    assert pool.expire(now=18) == ["a"]
    assert pool.expire(now=25.5) == ["c"]
    assert pool.pages_in_use == 0 and pool.expire(now=1e9) == []
    # a lease taken after everything expired is still found
    pool.allocate("d", PAGE, now=100)
    assert pool.expire(now=110) == ["d"]
