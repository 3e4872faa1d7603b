"""Runs KV loads concurrently, each bounded by a deadline, so that a dead or slow peer
costs only its own requests: a load waits off the thread pool until its peer is ready (its
handshake resolved), and one peer may hold at most half the threads.

A load past its deadline is reported failed at once (its blocks become load errors and
``kv_load_failure_policy`` decides); its thread may still be waiting on the peer, but it can
no longer write KV blocks: writes go through a gate that the timeout closes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Generic, TypeVar

Spec = TypeVar("Spec")
Result = TypeVar("Result")
LOAD_THREADS = 8
PER_PEER_THREADS = LOAD_THREADS // 2
PARKED_POLL_S = 0.001  # how often `wait` looks whether a parked load's peer is ready


class LoadTimeout(TimeoutError):
    """A load that ran past its deadline tried to write KV blocks."""


class WriteGate:
    """Held while a load writes KV blocks; closed for good when the load times out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reported = False  # under _lock: the load's outcome was handed to vLLM

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._lock:
            if self.reported:
                raise LoadTimeout("the load timed out before writing its KV")
            yield

    def report_once(self) -> bool:
        with self._lock:
            first, self.reported = not self.reported, True
            return first


class Loader(Generic[Spec, Result]):
    """``run(spec, gate)`` does one load (raising on failure); ``fail(spec, reason)`` makes
    the result of a failed one. Results come out of ``take_finished`` exactly once."""

    def __init__(
        self,
        run: Callable[[Spec, WriteGate], Result],
        fail: Callable[[Spec, str], Result],
        timeout_s: float,
    ) -> None:
        self._run, self._fail, self.timeout_s = run, fail, timeout_s
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="qaic-kv-load")
        self._lock = threading.Lock()
        self._reported = threading.Condition(self._lock)  # notified as loads finish
        self._in_flight: dict[int, tuple[Spec, WriteGate, float]] = {}
        self._parked: list[tuple[Spec, WriteGate, Hashable, Callable[[], bool] | None]] = []
        self._running: Counter[Hashable] = Counter()
        self._finished: list[Result] = []

    def submit(
        self, spec: Spec, peer: Hashable = None, ready: Callable[[], bool] | None = None
    ) -> int:
        """Runs ``spec`` once ``ready()`` (must not block) and ``peer`` has a free thread;
        returns the load's key for `wait`."""
        gate = WriteGate()
        with self._lock:
            self._in_flight[id(gate)] = (spec, gate, time.monotonic() + self.timeout_s)
            self._parked.append((spec, gate, peer, ready))
        self.dispatch()
        return id(gate)

    def dispatch(self) -> None:
        """Starts the parked loads that can start. Called on every event that can free one
        (a submit, a finished load, a resolved handshake), not only on the engine's steps: an
        idle engine may not step again until its request is loaded."""
        with self._lock:
            waiting = []
            for spec, gate, peer, ready in self._parked:
                if gate.reported:
                    continue  # timed out while it waited
                if self._running[peer] >= PER_PEER_THREADS or (ready and not ready()):
                    waiting.append((spec, gate, peer, ready))
                    continue
                self._running[peer] += 1
                self._pool.submit(self._guarded, spec, gate, peer)
            self._parked = waiting

    def _guarded(self, spec: Spec, gate: WriteGate, peer: Hashable) -> None:
        try:
            result = self._run(spec, gate)
        except Exception as exc:
            result = self._fail(spec, str(exc))  # which logs it, naming the request
        with self._lock:
            self._running[peer] -= 1
        self._finish(gate, result)
        self.dispatch()

    def _finish(self, gate: WriteGate, result: Result) -> None:
        if gate.report_once():
            with self._lock:
                self._in_flight.pop(id(gate), None)
                self._finished.append(result)
                self._reported.notify_all()

    def wait(self, keys: list[int], timeout_s: float) -> None:
        """Returns once the loads of ``keys`` are done, or after ``timeout_s``: an idle
        engine waits this long for a quick load rather than a whole step (a slow one stays
        asynchronous). A load parked until its peer's handshake resolves starts meanwhile."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self.dispatch()
            with self._reported:
                if self._in_flight.keys().isdisjoint(keys):
                    return
                self._reported.wait(min(left, PARKED_POLL_S))

    def take_finished(self) -> list[Result]:
        """Loads done since the last call, and loads past their deadline (as failed)."""
        self.dispatch()
        now = time.monotonic()
        with self._lock:
            overdue = [(s, g) for s, g, deadline in self._in_flight.values() if deadline <= now]
        for spec, gate in overdue:
            reason = f"load did not finish within load_timeout_s={self.timeout_s:g}"
            self._finish(gate, self._fail(spec, reason))
        with self._lock:
            done, self._finished = self._finished, []
            return done

    def shutdown(self) -> None:
        """Does not wait: a load blocked on a dead peer must not hold up the engine's exit."""
        self._pool.shutdown(wait=False, cancel_futures=True)
