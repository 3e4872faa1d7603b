"""The worker half: its transport and peers set up when vLLM registers the KV cache
(`registration`), the handshake metadata, and each step's loads and saves handed to
`request_loads` / `request_saves`, with their stats."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_qaic_connector.config import ConnectorConfig
from vllm_qaic_connector.kv.copy_pool import CopyPool
from vllm_qaic_connector.kv.kv_groups import KVGroup, groups_of
from vllm_qaic_connector.layout import KVGeometry, KVLayout
from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol.peers import PeerDirectory
from vllm_qaic_connector.protocol.wire import RankMetadata, ReleaseRequest, parse_ack
from vllm_qaic_connector.region_headers import RegionHeaders, new_incarnation
from vllm_qaic_connector.stats import PER_PEER_PREFIX, QAICConnectorStats
from vllm_qaic_connector.step_metadata import QAICConnectorMetadata
from vllm_qaic_connector.transports import KVTransport, create_transport, staging_name
from vllm_qaic_connector.transports.shared_cache import host_identity
from vllm_qaic_connector.worker.direct_reads import DirectReader, dense_blocks
from vllm_qaic_connector.worker.loader import Loader
from vllm_qaic_connector.worker.registration import (
    LocalCache,
    RankIdentity,
    Views,
    local_cache,
    rank_metadata,
    rank_of,
)
from vllm_qaic_connector.worker.request_loads import RequestLoads
from vllm_qaic_connector.worker.request_saves import RequestSaves

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = get_logger(__name__)  # inside vLLM's logger tree, so it is printed

# An engine with nothing to compute waits this long, at most, for the loads it started in
# the same step: one that lands in time is reported a whole engine step sooner (~1-2 ms
# of a first token here); a slower one goes on asynchronously.
IDLE_LOAD_WAIT_S = 0.005


@dataclass
class QAICHandshakeMetadata(KVConnectorHandshakeMetadata):
    rank: RankMetadata


@dataclass
class QAICWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: acknowledgements that free staging."""

    acks: list[ReleaseRequest]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, QAICWorkerMetadata)
        return QAICWorkerMetadata(self.acks + other.acks)


class WorkerSide:
    def __init__(
        self,
        cfg: ConnectorConfig,
        identity: RankIdentity,
        geometry: KVGeometry,
        groups: tuple[KVGroup, ...] = (),
    ) -> None:
        self.cfg, self.identity, self.geometry = cfg, identity, geometry
        self.groups = groups  # KV cache groups (empty: one, every layer in it)
        self.cache: LocalCache | None = None  # set by register_kv_caches
        self.layer_modules: dict[str, Any] = {}  # Mamba layers hold their state views
        self.layout_name: str | None = None  # the KV cache layout vLLM resolved
        self.transport: KVTransport | None = None
        self.rank_meta: RankMetadata | None = None
        self.incarnation = new_incarnation()
        self._key = cfg.shared_key
        self.peers = PeerDirectory(identity.engine_id, self._key, cfg.handshake_timeout_s)
        self.loads: RequestLoads | None = None
        self._loader: Loader | None = None
        self.saves: RequestSaves | None = None
        self._copies = CopyPool()
        self._direct = DirectReader(self._copies)
        self._load_errors: set[int] = set()
        # With several KV cache groups block ids are not unique, so vLLM takes failed
        # loads by request id (failed_recving) instead of by block.
        self._failed_requests: set[str] = set()
        self._stats = QAICConnectorStats()
        self._stats_lock = threading.Lock()
        self._metadata: QAICConnectorMetadata | None = None
        self._started: list[int] = []  # this step's loads (`Loader.submit` keys)

    @property
    def layers(self) -> list[Views]:
        return self.cache.layers if self.cache else []

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, cfg: ConnectorConfig, kv_cache_config: KVCacheConfig
    ) -> WorkerSide:
        identity, geometry = rank_of(vllm_config, kv_cache_config)
        worker = cls(cfg, identity, geometry, groups_of(kv_cache_config))
        worker.layer_modules = vllm_config.compilation_config.static_forward_context
        layout = getattr(kv_cache_config, "kv_cache_layout", None)
        worker.layout_name = "mla_latent" if vllm_config.model_config.use_mla else layout
        return worker

    # --- registration ----------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], layout: KVLayout | None = None
    ) -> None:
        cache = self.cache = local_cache(
            kv_caches, self.identity, self.geometry, self.groups, self.layer_modules, layout,
            self.cfg.verify_cpu_layout, self.layout_name,
        )  # fmt: skip
        name = staging_name(self.identity.engine_id, self.identity.tp_rank, self.incarnation)
        transport = self.transport = create_transport(
            self.cfg.transport, name, self.cfg.pool_bytes, self.cfg.load_timeout_s,
            stages=self.identity.produces,
        )  # fmt: skip
        # Direct reads move whole blocks: each must be one dense run (not LHBNC's), in
        # memory the transport shares. A GPU copies from and to staging, page-locked.
        on_gpu = cache.device.type == "cuda"
        if on_gpu:
            transport.pin_host_memory()
        one_group = cache.state is None and len(self.groups) <= 1 and dense_blocks(cache)
        one_group &= transport.shares_device_memory or not on_gpu
        direct = one_group and getattr(self.cfg, transport.direct_reads_key)
        shared = transport.share_kv_cache(cache.tensors, self.identity.produces) if direct else None
        self.saves = RequestSaves(self.cfg, cache, RegionHeaders(transport.staging), self._copies)
        self.rank_meta = self.peers.ours = rank_metadata(
            self.identity, self.incarnation, cache, self.groups, transport.endpoint(),
            shared if self.identity.produces else None, host_identity() if direct else "",
        )  # fmt: skip
        self.loads = RequestLoads(
            self.cfg, cache, self.rank_meta, transport, self.peers, self._direct, self._copies
        )
        self._loader = Loader(self.loads.load, self.loads.failed, self.cfg.load_timeout_s)
        self.peers.when_resolved(self._loader.dispatch)  # parked loads start at once
        logger.info(
            "QAICConnector worker rank %d: %s layout, %d layers, block %d, %s",
            self.identity.tp_rank, cache.layout.kind, len(cache.tensors), self.geometry.block_size,
            self.cfg.transport,
        )  # fmt: skip

    def handshake_metadata(self) -> QAICHandshakeMetadata | None:
        return None if self.rank_meta is None else QAICHandshakeMetadata(self.rank_meta)

    # --- per step ----------------------------------------------------------------------------

    def bind(self, metadata: QAICConnectorMetadata | None) -> None:
        self._metadata = metadata
        if metadata is not None and self.saves is not None:
            self.saves.hold(metadata.await_saves)

    def handle_preemptions(self, metadata: QAICConnectorMetadata) -> None:
        if self.saves is not None:
            self.saves.finish(metadata.preempted)

    def start_load_kv(self) -> None:
        self._started = []
        if self._metadata is None or self._loader is None:
            return
        for spec in self._metadata.loads:
            if spec.remote is None or spec.error is not None:
                self._started.append(self._loader.submit(spec))  # fails at once
                continue
            peer = (spec.remote.remote_host, spec.remote.remote_port)
            self.peers.poll(*peer)  # starts the handshake, or retries one that failed a while ago
            ready = functools.partial(self._peer_resolved, *peer)
            self._started.append(self._loader.submit(spec, peer, ready))
        if any(spec.in_step for spec in self._metadata.loads):  # read by the forward pass next:
            self._loader.wait(self._started, self._loader.timeout_s)  # up to their deadline

    def _peer_resolved(self, host: str, port: int) -> bool:
        # retry=False: a busy loader that looks late must not start the handshake over.
        return self.peers.poll(host, port, retry=False) is not None

    def wait_for_save(self) -> None:
        if self._metadata is not None and self.saves is not None:
            self.saves.run(self._metadata)

    def take_acknowledgements(self) -> QAICWorkerMetadata | None:
        """Decode ranks' acknowledgements that arrived with their reads (prefill side)."""
        if self.transport is None:
            return None
        acks = [a for m in self.transport.poll_notifications() if (a := parse_ack(m, self._key))]
        return QAICWorkerMetadata(acks) if acks else None

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self._started and self._metadata and self._metadata.idle and self._loader:
            self._loader.wait(self._started, IDLE_LOAD_WAIT_S)
        self._started = []
        done: set[str] = set()
        # Loads in the step are over by now (done, or failed at their deadline): vLLM runs
        # their requests already, so they are never reported as finished.
        loads = self._metadata.loads if self._metadata else []
        in_step = {spec.request_id for spec in loads if spec.in_step}
        for result in self._loader.take_finished() if self._loader else ():
            if result.request_id not in in_step:
                done.add(result.request_id)
            with self._stats_lock:
                if result.failed_blocks:
                    self._stats.add("load_failures")
                    if len(self.groups) > 1:
                        self._failed_requests.add(result.request_id)
                    else:
                        self._load_errors |= result.failed_blocks
                else:
                    self._stats.add("loaded_requests")
                    self._stats.add(PER_PEER_PREFIX + result.source_engine)
                    self._stats.add("loaded_tokens", result.tokens)
                    self._stats.add("bytes_copied", result.bytes_copied)
                    self._stats.add("read_descriptors", result.reads)
                    self._stats.add("direct_reads", int(result.direct))
                    self._stats.sample("load_seconds", result.seconds)
                    self._stats.sample("read_seconds", result.read_seconds)
        self._direct.drop_dead()
        sending = self.saves.finished_sending() if self.saves else set()
        return sending or None, done or None

    def take_failed_requests(self) -> set[str]:
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_stats(self) -> QAICConnectorStats | None:
        with self._stats_lock:
            self._stats.add("handshakes", self.peers.take_handshakes())
            if self.saves is not None:
                self._stats.aggregate(self.saves.take_stats())
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, QAICConnectorStats()
            return out

    def shutdown(self) -> None:
        if self.saves is not None:
            self.saves.shutdown()
        if self._loader is not None and self.loads is not None:
            self._loader.shutdown()
            self.loads.shutdown()
        self._direct.close()
        self._copies.close()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
