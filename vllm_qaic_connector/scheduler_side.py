"""The scheduler half, by the direction KV moves: what leaves this engine (`kv_sender`: a
prefill's handoffs, and the blocks and tickets of a decode's `kept_turns`), what arrives
(`kv_receiver`: a decode's loads, a prefill's load of an earlier turn), and the
side-channel listener they answer on. It holds no tensors, layouts or transports."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

from vllm_qaic_connector.config import ConnectorConfig, is_loopback
from vllm_qaic_connector.kv.kv_groups import attention_geometry, groups_of, has_state
from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol import wire
from vllm_qaic_connector.protocol.peers import PeerDirectory
from vllm_qaic_connector.protocol.routed_params import NOT_ROUTED, RoutedParams, routed_params
from vllm_qaic_connector.protocol.side_channel import SideChannelServer
from vllm_qaic_connector.scheduler.kept_turns import KeptTurns
from vllm_qaic_connector.scheduler.kv_receiver import KVReceiver
from vllm_qaic_connector.scheduler.kv_sender import (
    KVSender,
    LocalEngine,
    answer_cap,
)
from vllm_qaic_connector.scheduler.staging import StagingPool
from vllm_qaic_connector.scheduler.staging_releases import StagingReleases
from vllm_qaic_connector.stats import QAICConnectorStats
from vllm_qaic_connector.step_metadata import QAICConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = get_logger(__name__)  # inside vLLM's logger tree, so it is printed
# How long an idle prefill keeps stepping after it stages: long enough for a decode's read
# (well under a second, unless it queues) to show in the gauge, short because an idle
# engine that steps takes ~1.6 cores here (engine core and worker, empty steps).
STEP_AFTER_STAGING_S = 3.0


class SchedulerSide:
    def __init__(
        self, vllm_config: VllmConfig, cfg: ConnectorConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.cfg = cfg
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.engine_id = str(ktc.engine_id)
        self.is_producer = bool(ktc.is_kv_producer)
        if cfg.reuse_turns and not self.is_producer:
            raise ValueError(
                "reuse_turns: a decode that keeps turns for the next prefill shares its KV "
                "cache and hands out tickets: run it with kv_role kv_both"
            )
        if cfg.reuse_turns and ktc.kv_load_failure_policy != "recompute":
            raise ValueError(
                "reuse_turns: a kept turn may be gone when its ticket is used (evicted, "
                "expired): run with kv_load_failure_policy recompute, so that such a load "
                "is computed instead of failing the request"
            )
        self.groups = groups_of(kv_cache_config)
        geometry = attention_geometry(kv_cache_config)
        self.pool = StagingPool(cfg.num_staging_pages, cfg.staging_page_bytes, cfg.lease_s)
        self._ranks: list[wire.RankMetadata] = []
        self._published_pages = 0  # the staging gauge's value as of the last step
        # By request, not by id: two live requests may share an id (vLLM's id randomization
        # off), and neither may act on the other's params.
        self._routed: weakref.WeakKeyDictionary[Request, RoutedParams] = weakref.WeakKeyDictionary()
        self.receiver = KVReceiver(cfg, self.groups, vllm_config.cache_config.enable_prefix_caching)
        self.peers = PeerDirectory(self.engine_id, cfg.shared_key, cfg.handshake_timeout_s)
        # Before the listener: a release may arrive as soon as it listens (a decode that
        # still holds a ticket of this engine's previous life).
        self.releases = StagingReleases(self.pool, has_state(self.groups))
        # Each data-parallel rank is an engine of its own: it listens on the configured port
        # plus its DP index, as NixlConnector's do (a fixed port would fail the second).
        port = cfg.side_channel_port and (
            cfg.side_channel_port + vllm_config.parallel_config.data_parallel_index
        )
        self._server = SideChannelServer(cfg.side_channel_host, port, self._handle, cfg.shared_key)
        engine = LocalEngine(
            self.engine_id, self.groups, geometry, kv_cache_config.num_blocks, self._server.port,
            answer_cap(vllm_config.model_config),
        )  # fmt: skip
        self.sender = KVSender(cfg, engine, self.releases, self.peers)
        self.turns = KeptTurns(self.sender) if cfg.reuse_turns else None
        if cfg.shared_key is None and not is_loopback(cfg.side_channel_host):
            logger.warning(
                "QAICConnector: side channel on %s without a key (allow_unauthenticated): "
                "anyone who reaches it can read staged KV and free staging",
                cfg.side_channel_host,
            )
        logger.info(
            "QAICConnector scheduler: engine %s, side channel %s:%d, staging %d pages x %d B",
            self.engine_id,
            cfg.advertise_host,
            self._server.port,
            self.pool.num_pages,
            self.pool.page_bytes,
        )

    # --- side channel --------------------------------------------------------------------

    def set_rank_metadata(self, ranks: list[wire.RankMetadata]) -> None:
        self._ranks = sorted(ranks, key=lambda r: r.tp_rank)
        self.sender.ranks = self._ranks
        self.peers.ours = self._ranks[0] if self._ranks else None

    def _handle(self, msg: wire.Message) -> wire.Message:
        if isinstance(msg, wire.HandshakeRequest):
            return wire.handshake_reply(msg, self._ranks)
        if isinstance(msg, wire.ReleaseRequest):
            for rid in msg.request_ids:
                self.releases.acknowledge(rid, msg, self._ranks)
            self.releases.expire()
            return wire.Ok()
        if isinstance(msg, wire.RenewRequest):
            return wire.Renewed([rid for rid in msg.request_ids if self.pool.renew(rid)])
        if isinstance(msg, wire.TurnRequest):  # a stream's router, for the ticket of its turn
            named = self.turns.named if self.turns else {}
            if (ticket := named.get(msg.turn_id)) is None:
                return wire.ErrorReply(
                    f"no turn kept as {msg.turn_id!r}: never kept (reuse_turns off, aborted, "
                    "under a block, no room) or given up since (released, evicted, expired)"
                )
            return wire.TurnReply(ticket)
        return wire.ErrorReply(f"unexpected message {type(msg).__name__}")

    def _routed_of(self, request: Request) -> RoutedParams:
        """The request's ``kv_transfer_params``, decoded once (where vLLM hands it over), the
        malformed refused by name: a prefill returns the refusal as its error, a decode fails
        the load with it, for kv_load_failure_policy."""
        if (routed := self._routed.get(request)) is None:
            raw = request.kv_transfer_params
            try:
                routed = routed_params(raw)
            except ValueError as exc:
                logger.error("QAICConnector: request %s: %s", request.request_id, exc)
                to_prefill = isinstance(raw, dict) and bool(raw.get("do_remote_decode"))
                routed = RoutedParams(do_remote_decode=to_prefill, error=str(exc))
            self._routed[request] = routed
        return routed

    def on_new_request(self, request: Request) -> None:
        """A decode renews a ticket's lease from the request's arrival. A prefill for a
        model with Mamba layers stops one token short: the decode needs the state before
        the last prompt token, and recomputes that token from it."""
        routed = self._routed_of(request)
        if routed.do_remote_prefill:
            self.receiver.arrived(request)
        if not (self.is_producer and routed.do_remote_decode and has_state(self.groups)):
            return
        if request.num_prompt_tokens > 1 and request.prompt_token_ids is not None:
            del request.prompt_token_ids[-1]  # (prompt embeddings: nothing to cut)
            del request._all_token_ids[-1]
            request.num_prompt_tokens -= 1
            request.max_tokens = 1

    # --- decode side: loads --------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        routed = self._routed_of(request)
        if routed.do_remote_decode and self.is_producer:
            admitted = self.sender.admit(request, routed)
            turn = routed.earlier_turn if self.cfg.reuse_turns else None
            if admitted[0] is None or turn is None:
                return admitted
            return self.receiver.claim(request, num_computed_tokens, routed, turn)
        # A prefill that could not stage says so in the params; a router passes them on
        # as they are: a failed load, for kv_load_failure_policy, never a silent recompute.
        if not (routed.do_remote_prefill or routed.error):
            return 0, False
        return self.receiver.claim(request, num_computed_tokens, routed)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        routed = self._routed.get(request, NOT_ROUTED)
        if routed.do_remote_decode and self.is_producer:
            self.sender.will_save(request)
        if self.receiver.allocated(request, blocks, num_external_tokens):
            self._routed[request] = routed.loaded()

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self.sender.kv_cache_manager = manager

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> QAICConnectorMetadata:
        self.releases.expire()
        if self.turns:
            self.turns.evict()
        released = self.sender.released_direct()  # before drain_freed
        if released and self.turns:  # not every step: only when blocks went
            self.turns.forget()
        # Before the seals: a kept turn released by then is never sealed (`take_seals`).
        invalidate = self.pool.drain_freed()
        seals = self.turns.take_seals() if self.turns else []
        return QAICConnectorMetadata(
            saves=seals + self.sender.saves_for_step(scheduler_output),
            loads=self.receiver.take(),
            invalidate=invalidate,
            await_saves=self.sender.take_await_saves(),
            release_direct=released,
            preempted=self.sender.preempted(scheduler_output),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )

    def update_connector_output(
        self, finished_recving: set[str] | None, acks: list[wire.ReleaseRequest]
    ) -> None:
        self.receiver.received(finished_recving or set())
        for ack in acks:  # acknowledgements that came with NIXL reads
            for rid in ack.request_ids:
                self.releases.acknowledge(rid, ack, self._ranks)

    def request_finished(self, request: Request) -> tuple[bool, Any]:
        routed = self._routed.pop(request, NOT_ROUTED)
        loading = self.receiver.finished(request.request_id)
        if self.turns and not loading and not self.sender.outgoing(request.request_id):
            return self.turns.keep(request, routed)  # a decode's turn, not a handoff
        return self.sender.finished(request, loading=loading)

    def has_pending_push_work(self) -> bool:
        """Staged KV held (or a gauge not yet told it went) within a while of the latest
        handoff: vLLM keeps stepping (an empty step sleeps 1 ms), so the gauge falls when
        the decode frees the pages, not at an idle prefill's next request. A lease that
        ends later, unread, is freed and shown at the prefill's next step."""
        held = self.pool.pages_in_use > 0 or self._published_pages > 0
        return held and time.monotonic() < self.pool.last_allocated + STEP_AFTER_STAGING_S

    def pool_stats(self) -> QAICConnectorStats:
        stats, self.sender.stats = self.sender.stats, QAICConnectorStats()
        self._published_pages = self.pool.pages_in_use
        stats.set("staging_pages_in_use", self._published_pages)
        stats.set("staging_pages_total", self.pool.num_pages)
        stats.add("lease_expiries", self.releases.take_expired())
        stats.add("handshakes", self.peers.take_handshakes())
        return stats

    def shutdown(self) -> None:
        self.receiver.close()
        self._server.close()
