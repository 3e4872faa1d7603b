"""The second copy thread: halves run on both threads, and a copy never waits behind
another copy's half."""

from __future__ import annotations

import threading

import pytest

from vllm_qaic_connector.kv import copy_pool
from vllm_qaic_connector.kv.copy_pool import CopyPool


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(copy_pool, "copy_threads", lambda: 2)  # whatever this host allows
    p = CopyPool()
    yield p
    p.close()


def test_a_split_runs_its_second_half_on_the_other_thread(pool: CopyPool) -> None:
    seen: list[tuple[int, int, str]] = []

    def work(lo: int, hi: int) -> int:
        seen.append((lo, hi, threading.current_thread().name))
        return hi - lo

    assert pool.split(work, 10, copy_pool.SPLIT_MIN_BYTES, 3) == 10
    assert sorted(seen)[0][:2] == (0, 3) and sorted(seen)[1][:2] == (3, 10)
    threads = {name for _, _, name in seen}
    assert threading.current_thread().name in threads and len(threads) == 2


def test_a_copy_runs_whole_here_while_the_other_thread_is_busy(pool: CopyPool) -> None:
    """A big copy's second half holds the thread; a small copy meanwhile must not queue
    behind it (it would wait until the big one is released)."""
    started, release = threading.Event(), threading.Event()

    def big(lo: int, hi: int) -> int:
        if lo > 0:  # the half on the second thread
            started.set()
            assert release.wait(10)
        return hi - lo

    done: list[int] = []
    big_copy = copy_pool.SPLIT_MIN_BYTES
    first = threading.Thread(target=lambda: done.append(pool.split(big, 8, big_copy)))
    first.start()
    assert started.wait(10)
    where: list[str] = []

    def small(lo: int, hi: int) -> int:
        where.append(threading.current_thread().name)
        return hi - lo

    finished = threading.Event()
    threading.Thread(target=lambda: (pool.split(small, 4, big_copy), finished.set())).start()
    try:
        assert finished.wait(5), "the small copy queued behind the big one's half"
        assert len(where) == 1 and not where[0].startswith("qaic-kv-copy")
    finally:
        release.set()
        first.join(10)
    assert done == [8]
    # the thread is free again (its release runs just after the big copy's result): split
    for _ in range(100):
        where.clear()
        assert pool.split(small, 4, big_copy) == 4
        if any(name.startswith("qaic-kv-copy") for name in where):
            break
    assert len(where) == 2 and any(name.startswith("qaic-kv-copy") for name in where)


def test_a_small_copy_runs_whole_here(pool: CopyPool) -> None:
    """Under SPLIT_MIN_BYTES the other thread's handoff costs more than its half saves."""
    seen: list[tuple[int, int, str]] = []

    def work(lo: int, hi: int) -> int:
        seen.append((lo, hi, threading.current_thread().name))
        return hi - lo

    assert pool.split(work, 10, copy_pool.SPLIT_MIN_BYTES - 1) == 10
    assert seen == [(0, 10, threading.current_thread().name)]
