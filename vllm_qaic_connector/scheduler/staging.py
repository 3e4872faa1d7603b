"""The staging pool's bookkeeping: fixed pages, contiguous runs, leases. Logical only.

The scheduler half owns this; the worker half owns the bytes. Both agree on offsets
because a request's region is always ``first_page * page_bytes``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass

_FREE, _USED = b"\x01", b"\x00"


@dataclass
class Lease:
    first_page: int
    num_pages: int
    expires_at: float
    holder: str = ""  # the decode it is staged for ("": not named)


class StagingPool:
    """A fixed number of fixed-size pages; a request takes one contiguous run.

    Never grows: when no run fits, ``allocate`` returns None and the caller waits or fails.
    Thread-safe, since releases arrive on the side-channel thread. The engine asks for
    pages, expiries and usage every step, so none of that walks every page or lease in
    Python: runs are found by a byte search, expiry waits for the earliest deadline.
    """

    def __init__(self, num_pages: int, page_bytes: int, lease_s: float) -> None:
        self.num_pages, self.page_bytes, self.lease_s = num_pages, page_bytes, lease_s
        self._free = bytearray(_FREE) * num_pages  # one byte per page
        self._leases: dict[str, Lease] = {}
        self._freed: list[int] = []  # offsets given up since `drain_freed`
        self._held_by: Counter[str] = Counter()  # pages in use, by holder
        self._next_expiry = math.inf  # no lease ends before this (renewals only delay)
        self.last_allocated = -math.inf  # monotonic time of the latest run taken
        self._lock = threading.Lock()

    def pages_for(self, num_bytes: int) -> int:
        return max(1, math.ceil(num_bytes / self.page_bytes))

    def allocate(
        self,
        request_id: str,
        num_bytes: int,
        now: float | None = None,
        holder: str = "",
        quota: int | None = None,
    ) -> int | None:
        """Reserve a run for ``num_bytes``; returns its byte offset, or None when full or
        when ``holder`` would pass its ``quota`` of pages (a holder with none may take one
        run of any size, so a long prompt still fits)."""
        need = self.pages_for(num_bytes)
        if need > self.num_pages:
            raise ValueError(
                f"request {request_id} needs {num_bytes} staging bytes, more than the whole "
                f"pool ({self.num_pages * self.page_bytes}); raise staging_bytes"
            )
        with self._lock:
            if request_id in self._leases:
                raise ValueError(
                    f"request id {request_id} is already staged by an earlier request whose "
                    "lease holds: request ids must be unique (vLLM randomizes them unless "
                    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set)"
                )
            held = self._held_by[holder]
            if quota is not None and held and held + need > quota:
                return None
            if (start := self._free.find(_FREE * need)) < 0:
                return None
            self._free[start : start + need] = _USED * need
            self._held_by[holder] += need
            expires = (time.monotonic() if now is None else now) + self.lease_s
            self._next_expiry = min(self._next_expiry, expires)
            self._leases[request_id] = Lease(start, need, expires, holder)
            self.last_allocated = time.monotonic() if now is None else now
            return start * self.page_bytes

    def release(self, request_id: str) -> bool:
        with self._lock:
            if (lease := self._leases.pop(request_id, None)) is None:
                return False
            first, n = lease.first_page, lease.num_pages
            self._free[first : first + n] = _FREE * n
            # A holder is dropped at 0 pages (Counter's -=): they are named by requests, keep few.
            self._held_by -= Counter({lease.holder: n})
            self._freed.append(first * self.page_bytes)
            return True

    def drain_freed(self) -> list[int]:
        """Offsets of regions released or expired since the last call (their headers must
        be invalidated, so a late reader sees they are gone)."""
        with self._lock:
            freed, self._freed = self._freed, []
            return freed

    def expire(self, now: float | None = None) -> list[str]:
        """Release every lease past its deadline; returns their request ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now < self._next_expiry:
                return []
            expired = [rid for rid, lease in self._leases.items() if lease.expires_at <= now]
            live = [lease.expires_at for lease in self._leases.values() if lease.expires_at > now]
            self._next_expiry = min(live, default=math.inf)
        return [rid for rid in expired if self.release(rid)]

    def renew(self, request_id: str, now: float | None = None) -> bool:
        """Restart a lease's clock; False if it is gone (expired or released)."""
        with self._lock:
            if (lease := self._leases.get(request_id)) is None:
                return False
            lease.expires_at = (time.monotonic() if now is None else now) + self.lease_s
            return True

    def expires_in(self, request_id: str) -> float:
        """Seconds until the request's lease ends (0 if it has none)."""
        with self._lock:
            lease = self._leases.get(request_id)
            return max(lease.expires_at - time.monotonic(), 0.0) if lease else 0.0

    def has(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def pages_held_by(self, holder: str) -> int:
        with self._lock:
            return self._held_by[holder]

    @property
    def pages_in_use(self) -> int:
        with self._lock:
            return self._held_by.total()  # over holders (few), not leases
