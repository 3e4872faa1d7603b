"""When a prefill's staged KV may go: once every (decode rank, prefill rank) read of it is
acknowledged, or when its lease runs out. Called from the side-channel thread (releases
sent over it) and the engine's (acknowledgements that came with NIXL reads, expiry)."""

from __future__ import annotations

import threading

from vllm_qaic_connector.kv.tp_mapping import reads_needed, source_ranks
from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol.wire import RankMetadata, ReleaseRequest
from vllm_qaic_connector.scheduler.staging import StagingPool

logger = get_logger(__name__)
MAX_TP = 1024  # bounds the work an acknowledgement can ask for


class StagingReleases:
    def __init__(self, pool: StagingPool, with_state: bool) -> None:
        """``with_state``: the model has Mamba layers, whose state shards add reads."""
        self.pool, self.with_state = pool, with_state
        self._acks: dict[str, set[tuple[int, int]]] = {}  # reads acknowledged, by request
        self._lock = threading.Lock()
        self._expired = 0  # leases expired since the last take_expired()

    def acknowledge(self, rid: str, ack: ReleaseRequest, ranks: list[RankMetadata]) -> None:
        """Frees the staging once every (decode rank, prefill rank) read is done: each of
        our ``ranks`` staged its own heads, and TP decode ranks read at their own pace."""
        total_heads = ranks[0].num_kv_heads if ranks else 1
        src_tp = max(len(ranks), 1)
        if not self.pool.has(rid) or not 0 <= ack.reader_rank < ack.reader_tp <= MAX_TP:
            return  # nothing staged under that id (any more), or a nonsense reader
        try:
            needed = reads_needed(total_heads, src_tp, ack.reader_tp, self.with_state)
            if (sources := ack.source_ranks) is None:
                args = (total_heads, src_tp, ack.reader_tp, ack.reader_rank, self.with_state)
                sources = source_ranks(*args)
        except ValueError as exc:
            logger.warning("QAICConnector: ignoring acknowledgement of %s: %s", rid, exc)
            return
        with self._lock:
            done = self._acks.setdefault(rid, set())
            done.update((ack.reader_rank, s) for s in sources)
            if not needed <= done:
                return
            del self._acks[rid]
        self.pool.release(rid)

    def expire(self) -> None:
        for rid in self.pool.expire():
            with self._lock:  # the side-channel thread and the engine's both expire
                self._expired += 1
                self._acks.pop(rid, None)
            logger.warning("QAICConnector: staging lease of request %s expired", rid)

    def take_expired(self) -> int:
        """Leases expired since the last call."""
        with self._lock:
            expired, self._expired = self._expired, 0
            return expired
