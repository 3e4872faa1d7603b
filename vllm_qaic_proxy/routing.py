"""Which prefill and which decode serve a request: least outstanding requests, or a
round-robin over every (prefill, decode) pair (the harness: each decode meets each prefill).
No I/O: the proxy reports when a leg starts and ends."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

DOWN_S = 5.0  # a backend that refused a connection is skipped this long


class LeastOutstanding:
    """Picks the backend with the fewest requests in flight; ties go round-robin, so an idle
    pool still spreads load and one slow backend never collects a queue."""

    def __init__(self, backends: list[str]) -> None:
        if not backends:  # a clear error at start-up, not a 500 on every request
            raise ValueError("no backends")
        self.outstanding = dict.fromkeys(backends, 0)
        self._turn = itertools.count()
        self._down_until = dict.fromkeys(backends, 0.0)

    def pick(self) -> str:
        up = {b: n for b, n in self.outstanding.items() if not self.is_down(b)}
        candidates = up or self.outstanding  # all down: try them all the same
        fewest = min(candidates.values())
        tied = [b for b, n in candidates.items() if n == fewest]
        return tied[next(self._turn) % len(tied)]

    def mark_down(self, backend: str) -> None:
        """``backend`` refused a connection: skip it for ``DOWN_S``."""
        self._down_until[backend] = time.monotonic() + DOWN_S

    def is_down(self, backend: str) -> bool:
        """Whether ``backend`` is skipped now (marked down, its time not up)."""
        return self._down_until.get(backend, 0.0) > time.monotonic()

    def failover(self, first: str) -> list[str]:
        """``first``, then every other backend that is up, in the order to try them."""
        rest = [b for b in self.outstanding if b != first and not self.is_down(b)]
        return [first, *sorted(rest, key=self.outstanding.__getitem__)]

    @contextmanager
    def busy(self, backend: str) -> Iterator[str]:
        """Counts ``backend`` as serving one more request for the ``with`` body."""
        self.outstanding[backend] += 1
        try:
            yield backend
        finally:
            self.outstanding[backend] -= 1


class Router:
    """``least-outstanding`` (default) picks each leg on its own; ``pairs`` cycles through
    every (prefill, decode) pair in order."""

    MODES = ("least-outstanding", "pairs")

    def __init__(self, prefills: list[str], decodes: list[str], mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"routing {mode!r}: choose one of {', '.join(self.MODES)}")
        self.prefills, self.decodes = LeastOutstanding(prefills), LeastOutstanding(decodes)
        self._pairs = itertools.cycle(itertools.product(prefills, decodes))
        self.mode = mode

    def route(self) -> tuple[str, str]:
        if self.mode == "pairs":
            return next(self._pairs)
        return self.prefills.pick(), self.decodes.pick()
