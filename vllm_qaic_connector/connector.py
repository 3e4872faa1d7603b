"""`QAICConnector`: the vLLM KV-connector entry class. It dispatches to one half by role."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from vllm_qaic_connector.config import parse_config, sized_staging
from vllm_qaic_connector.scheduler_side import SchedulerSide
from vllm_qaic_connector.stats import QAICConnectorStats, QAICPromMetrics
from vllm_qaic_connector.step_metadata import QAICConnectorMetadata
from vllm_qaic_connector.worker_side import QAICHandshakeMetadata, QAICWorkerMetadata, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class QAICConnector(KVConnectorBase_V1, SupportsHMA):
    """Hybrid models (HMA) are supported: each KV cache group is moved by its own block
    table, a sliding-window group only from its window's start (see kv_groups.py)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if (pp := vllm_config.parallel_config.pipeline_parallel_size) > 1:
            raise ValueError(  # each half, as vLLM makes it (no earlier hook in vLLM 0.32)
                f"QAICConnector does not support pipeline parallelism (--pipeline-parallel-size "
                f"{pp}): each stage holds part of the layers; use tensor or data parallelism"
            )
        extra = self._kv_transfer_config.kv_connector_extra_config
        cfg = sized_staging(parse_config(extra), vllm_config, kv_cache_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config, cfg, kv_cache_config)
        else:
            self.worker = WorkerSide.from_vllm(vllm_config, cfg, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        ktc = vllm_config.kv_transfer_config
        return parse_config(ktc.kv_connector_extra_config if ktc else None).kv_cache_layout

    # --- worker role --------------------------------------------------------------------

    def _w(self) -> WorkerSide:
        assert self.worker is not None, "worker-side call on the scheduler connector"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, QAICConnectorMetadata)
        self._w().bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._w().bind(None)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, QAICConnectorMetadata)
        self._w().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._w().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: whole-request loads, done in start_load_kv or async."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing to do per layer: the whole prompt is staged in wait_for_save."""

    def wait_for_save(self) -> None:
        self._w().wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, done = self._w().get_finished()
        return KVConnectorTransferResults(
            finished_sending=sent or set(),
            finished_recving=done or set(),
            failed_recving=self._w().take_failed_requests(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().get_block_ids_with_load_errors()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._w().handshake_metadata()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._w().take_acknowledgements()

    def get_kv_connector_stats(self) -> QAICConnectorStats | None:
        # vLLM asks both roles: transfer counters live on the worker, pool gauges on the
        # scheduler (producers only).
        if self.worker is not None:
            return self.worker.get_stats()
        return self._s().pool_stats() if self._s().is_producer else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # --- scheduler role -----------------------------------------------------------------

    def _s(self) -> SchedulerSide:
        assert self.scheduler is not None, "scheduler-side call on a worker connector"
        return self.scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s().bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        ranks = [m.rank for m in metadata.values() if isinstance(m, QAICHandshakeMetadata)]
        self._s().set_rank_metadata(ranks)

    def on_new_request(self, request: Request) -> None:
        self._s().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        acks = meta.acks if isinstance(meta, QAICWorkerMetadata) else []
        self._s().update_connector_output(connector_output.finished_recving, acks)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request)

    # --- stats -------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> QAICConnectorStats:
        return QAICConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> QAICPromMetrics:
        return QAICPromMetrics(*args, **kwargs)  # vllm_config, metric_types, labelnames, ...
