"""Lease renewal, decode side: while a request still wants its staged KV (queued, waiting
for blocks, or loading), the decode renews the prefill's lease on it, every third of the
lease. A decode that died or forgot the request stops renewing, and the lease runs out.

It also knows until when each lease holds (the ticket's expiry, pushed back by each renewal
the prefill confirmed), so a load that would start after it fails at once instead of
reading a region that is no longer ours.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from operator import attrgetter

from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.ticket import RemotePrefill
from vllm_qaic_connector.protocol.wire import Renewed, RenewRequest

logger = get_logger(__name__)
MIN_PERIOD_S, MAX_PERIOD_S = 0.1, 10.0
# The prefill's staged request a ticket names: requests here that share one share its lease.
_staged_at = attrgetter("remote_host", "remote_port", "remote_request_id")


class LeaseRenewer:
    def __init__(self, key: bytes | None, timeout_s: float) -> None:
        self._key, self._timeout_s = key, timeout_s
        self._wanted: dict[str, RemotePrefill] = {}
        self._holds_until: dict[str, float] = {}  # unix time
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def want(self, request_id: str, remote: RemotePrefill) -> None:
        with self._lock:
            self._wanted[request_id] = remote  # again at claim: renewals already taken hold
            self._holds_until[request_id] = max(self._holds_until.get(request_id, 0.0),
                                                remote.expires_at)  # fmt: skip
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="qaic-leases", daemon=True)
                self._thread.start()

    def holds_until(self, request_id: str) -> float:
        """Unix time the request's lease is known to hold until (0: not wanted)."""
        with self._lock:
            return self._holds_until.get(request_id, 0.0)

    def drop(self, request_id: str) -> RemotePrefill | None:
        """Stops renewing the request's lease; returns the ticket it renewed, if any."""
        with self._lock:
            self._holds_until.pop(request_id, None)
            return self._wanted.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """The request is gone before its KV was read (aborted, dropped): the prefill frees
        its staging now, not at the lease's end (in the background: never the scheduler's
        wait), unless another request here still wants the same ticket."""
        remote = self.drop(request_id)
        with self._lock:
            others = {_staged_at(r) for r in self._wanted.values()}
        # Not while a sibling (n > 1) that shares the ticket still wants it.
        if remote is not None and _staged_at(remote) not in others:
            args = (remote, self._key, self._timeout_s)
            threading.Thread(target=side_channel.release, args=args, daemon=True).start()

    def _period(self) -> float:
        with self._lock:
            shortest = min((r.lease_s for r in self._wanted.values()), default=3 * MAX_PERIOD_S)
        return min(max(shortest / 3, MIN_PERIOD_S), MAX_PERIOD_S)

    def _run(self) -> None:
        while not self._stop.wait(self._period()):
            by_peer: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
            with self._lock:
                for rid, remote in self._wanted.items():
                    by_peer[remote.remote_host, remote.remote_port][remote.remote_request_id] = rid
            for (host, port), ids in by_peer.items():
                self._renew(host, port, ids)

    def _renew(self, host: str, port: int, ids: dict[str, str]) -> None:
        """``ids``: the prefill's request id -> ours."""
        sent = time.time()
        timeout = min(self._timeout_s, self._period())
        try:
            reply = side_channel.call(host, port, RenewRequest(list(ids)), self._key, timeout)
        except ConnectionError as exc:  # its loads fail, or its lease ends, on their own
            logger.debug("QAICConnector: renewal at %s:%d failed: %s", host, port, exc)
            return
        if not isinstance(reply, Renewed):
            return
        with self._lock:
            for rid in (ids[r] for r in reply.request_ids if r in ids):
                if (remote := self._wanted.get(rid)) is not None:
                    self._holds_until[rid] = max(self._holds_until[rid], sent + remote.lease_s)

    def close(self) -> None:
        self._stop.set()
