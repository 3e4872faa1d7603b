"""Lease renewal, decode side: while a request still wants its staged KV (queued, waiting
for blocks, or loading), the decode renews the prefill's lease on it, every third of the
lease. A decode that died or forgot the request stops renewing, and the lease runs out."""

from __future__ import annotations

import threading
from collections import defaultdict

from vllm.logger import init_logger

from vllm_qaic_connector import side_channel
from vllm_qaic_connector.wire import RemotePrefill, RenewRequest

logger = init_logger(f"vllm.{__name__}")
MIN_PERIOD_S, MAX_PERIOD_S = 0.1, 10.0


class LeaseRenewer:
    def __init__(self, key: bytes | None, timeout_s: float) -> None:
        self._key, self._timeout_s = key, timeout_s
        self._wanted: dict[str, RemotePrefill] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def want(self, request_id: str, remote: RemotePrefill) -> None:
        with self._lock:
            self._wanted[request_id] = remote
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="qaic-lease-renewal", daemon=True
                )
                self._thread.start()

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._wanted.pop(request_id, None)

    def _period(self) -> float:
        with self._lock:
            shortest = min((r.lease_s for r in self._wanted.values()), default=3 * MAX_PERIOD_S)
        return min(max(shortest / 3, MIN_PERIOD_S), MAX_PERIOD_S)

    def _run(self) -> None:
        while not self._stop.wait(self._period()):
            by_peer: dict[tuple[str, int], list[str]] = defaultdict(list)
            with self._lock:
                for remote in self._wanted.values():
                    peer = (remote.remote_host, remote.remote_port)
                    by_peer[peer].append(remote.remote_request_id)
            for (host, port), ids in by_peer.items():
                timeout = min(self._timeout_s, self._period())
                try:
                    side_channel.call(host, port, RenewRequest(ids), self._key, timeout)
                except ConnectionError as exc:  # its loads fail on their own; keep going
                    logger.debug("QAICConnector: renewal at %s:%d failed: %s", host, port, exc)

    def close(self) -> None:
        self._stop.set()
