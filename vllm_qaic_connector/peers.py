"""Handshakes with peer engines, done once per peer and cached.

Both halves use it: the decode worker before a load, and the prefill scheduler to learn the
decode's layout before it stages (without blocking the engine: `poll` never waits).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from vllm.logger import init_logger

from vllm_qaic_connector import side_channel
from vllm_qaic_connector.side_channel import SideChannelTimeout
from vllm_qaic_connector.wire import (
    PROTOCOL_VERSION,
    HandshakeReply,
    HandshakeRequest,
    RankMetadata,
    incompatibility,
)

logger = init_logger(f"vllm.{__name__}")  # inside vLLM's logger tree, so it is printed
RETRY_AFTER_S = 2.0
HANDSHAKE_ATTEMPTS = 3


@dataclass
class _Entry:
    done: threading.Event
    ranks: list[RankMetadata] | None = None
    error: str | None = None
    finished: float = 0.0


class PeerDirectory:
    def __init__(self, engine_id: str, key: bytes | None, timeout_s: float) -> None:
        self.engine_id = engine_id
        self.key = key
        self.timeout_s = timeout_s
        self.ours: RankMetadata | None = None  # set once our workers registered
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._lock = threading.Lock()

    def _handshake(self, host: str, port: int) -> list[RankMetadata]:
        request = HandshakeRequest(PROTOCOL_VERSION, self.engine_id)
        for attempt in range(1, HANDSHAKE_ATTEMPTS + 1):
            try:
                reply = side_channel.call(host, port, request, self.key, self.timeout_s)
                break
            except SideChannelTimeout:
                # A busy peer on an oversubscribed host can miss one deadline; a dead one
                # misses them all.
                if attempt == HANDSHAKE_ATTEMPTS:
                    raise ConnectionError(
                        f"side channel {host}:{port} silent {attempt} times "
                        f"({self.timeout_s}s each)"
                    ) from None
        if not isinstance(reply, HandshakeReply) or not reply.ranks:
            raise ConnectionError(f"bad handshake reply from {host}:{port}")
        if self.ours is not None:
            problem = incompatibility(self.ours, reply.ranks[0])
            if problem:
                raise ConnectionError(f"incompatible peer at {host}:{port}: {problem}")
        return reply.ranks

    def _run(self, host: str, port: int, entry: _Entry) -> None:
        try:
            entry.ranks = self._handshake(host, port)
            peer = entry.ranks[0]
            logger.info(
                "QAICConnector: handshake with %s at %s:%d: %s layout, block %d, TP %d",
                peer.engine_id,
                host,
                port,
                peer.layout_kind,
                peer.block_size,
                peer.tp_size,
            )
        except ConnectionError as exc:
            entry.error = str(exc)
            logger.warning("QAICConnector: %s", exc)
        entry.finished = time.monotonic()
        entry.done.set()

    def _entry(self, host: str, port: int) -> _Entry:
        with self._lock:
            entry = self._entries.get((host, port))
            stale = (
                entry is not None
                and entry.error is not None
                and time.monotonic() - entry.finished > RETRY_AFTER_S
            )
            if entry is None or stale:
                # A failed handshake is retried after a pause, not cached forever.
                entry = _Entry(threading.Event())
                self._entries[(host, port)] = entry
                threading.Thread(
                    target=self._run, args=(host, port, entry), daemon=True, name="qaic-handshake"
                ).start()
            return entry

    def poll(self, host: str, port: int) -> list[RankMetadata] | str | None:
        """Ranks if known, an error string if the handshake failed, None while pending."""
        entry = self._entry(host, port)
        if not entry.done.is_set():
            return None
        return entry.ranks if entry.ranks is not None else entry.error

    def get(self, host: str, port: int) -> list[RankMetadata]:
        """Blocking lookup, bounded by the handshake timeout. Raises ConnectionError."""
        entry = self._entry(host, port)
        if not entry.done.wait(HANDSHAKE_ATTEMPTS * self.timeout_s + 1.0):
            raise ConnectionError(f"handshake with {host}:{port} timed out")
        if entry.ranks is None:
            raise ConnectionError(entry.error or f"handshake with {host}:{port} failed")
        return entry.ranks
