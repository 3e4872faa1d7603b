"""The scheduler half: a decode's loads (kv_transfer_params checked, tokens claimed, blocks
handed to the worker), a prefill's handoffs (`prefill_handoffs`), and the side-channel
listener both answer on. It holds no tensors, layouts or transports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_qaic_connector.config import ConnectorConfig, is_loopback
from vllm_qaic_connector.kv_groups import (
    attention_spec,
    groups_of,
    has_state,
    load_starts,
    staging_gap,
    tokens_to_load,
)
from vllm_qaic_connector.layout import KVGeometry
from vllm_qaic_connector.lease_renewal import LeaseRenewer
from vllm_qaic_connector.peers import PeerDirectory
from vllm_qaic_connector.prefill_handoffs import PrefillEngine, PrefillHandoffs
from vllm_qaic_connector.side_channel import SideChannelServer
from vllm_qaic_connector.staging import StagingPool
from vllm_qaic_connector.staging_releases import StagingReleases
from vllm_qaic_connector.stats import QAICConnectorStats
from vllm_qaic_connector.step_metadata import LoadSpec, QAICConnectorMetadata
from vllm_qaic_connector.tickets import prompt_hash
from vllm_qaic_connector.wire import (
    PROTOCOL_VERSION,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Message,
    Ok,
    RankMetadata,
    ReleaseRequest,
    RemotePrefill,
    Renewed,
    RenewRequest,
    parse_remote_prefill,
    ticket_problem,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # inside vLLM's logger tree, so it is printed


class SchedulerSide:
    def __init__(
        self, vllm_config: VllmConfig, cfg: ConnectorConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.cfg = cfg
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.engine_id = str(ktc.engine_id)
        self.is_producer = bool(ktc.is_kv_producer)
        self.groups = groups_of(kv_cache_config)
        spec = attention_spec(kv_cache_config)
        geometry = KVGeometry(
            spec.num_kv_heads,  # type: ignore[attr-defined]
            spec.head_size,  # type: ignore[attr-defined]
            spec.block_size,
            spec.dtype,  # type: ignore[attr-defined]
        )
        self.pool = StagingPool(cfg.num_staging_pages, cfg.staging_page_bytes, cfg.lease_s)
        self._ranks: list[RankMetadata] = []
        self._matched: dict[str, tuple[int, RemotePrefill | None, str | None]] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._loading: set[str] = set()  # loads handed to the worker, not yet reported done
        self._key = cfg.shared_key
        self._renewer = LeaseRenewer(self._key, cfg.handshake_timeout_s)
        self.peers = PeerDirectory(self.engine_id, self._key, cfg.handshake_timeout_s)
        # Before the listener: a release may arrive as soon as it listens (a decode that
        # still holds a ticket of this engine's previous life).
        self.releases = StagingReleases(self.pool, has_state(self.groups))
        self._server = SideChannelServer(
            cfg.side_channel_host, cfg.side_channel_port, self._handle, self._key
        )
        engine = PrefillEngine(
            self.engine_id, self.groups, geometry, kv_cache_config.num_blocks, self._server.port
        )
        self.handoffs = PrefillHandoffs(cfg, engine, self.releases, self.peers)
        if self._key is None and not is_loopback(cfg.side_channel_host):
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

    def set_rank_metadata(self, ranks: list[RankMetadata]) -> None:
        self._ranks = sorted(ranks, key=lambda r: r.tp_rank)
        self.handoffs.ranks = self._ranks
        self.peers.ours = self._ranks[0] if self._ranks else None

    def _handle(self, msg: Message) -> Message:
        if isinstance(msg, HandshakeRequest):
            if msg.version != PROTOCOL_VERSION:
                return ErrorReply(f"protocol version {msg.version}, we speak {PROTOCOL_VERSION}")
            if not self._ranks:
                return ErrorReply("engine not ready: workers have not registered KV caches")
            return HandshakeReply(PROTOCOL_VERSION, self._ranks)
        if isinstance(msg, ReleaseRequest):
            for rid in msg.request_ids:
                self.releases.acknowledge(rid, msg, self._ranks)
            self.releases.expire()
            return Ok()
        if isinstance(msg, RenewRequest):
            return Renewed([rid for rid in msg.request_ids if self.pool.renew(rid)])
        return ErrorReply(f"unexpected message {type(msg).__name__}")

    def on_new_request(self, request: Request) -> None:
        """A prefill for a model with Mamba layers stops one token short: the decode needs
        the state before the last prompt token, and recomputes that token from it."""
        params = request.kv_transfer_params
        if not (self.is_producer and has_state(self.groups) and params):
            return
        if params.get("do_remote_decode") and request.num_prompt_tokens > 1:
            if request.prompt_token_ids is None:  # prompt embeddings: nothing to cut
                return
            del request.prompt_token_ids[-1]
            del request._all_token_ids[-1]
            request.num_prompt_tokens -= 1
            request.max_tokens = 1

    # --- decode side: loads --------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and self.is_producer:
            return self.handoffs.admit(request, params)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote: RemotePrefill | None = None
        error: str | None = None
        prompt = request.prompt_token_ids or []
        try:
            parsed = parse_remote_prefill(params)
            num_tokens = parsed.num_tokens
            unusable = ticket_problem(parsed, self._key)
            if unusable:  # before anything else: an unsigned peer address is not contacted
                raise ValueError(unusable)
            if num_tokens > len(prompt):
                raise ValueError(
                    f"malformed kv_transfer_params: num_tokens={num_tokens} exceeds "
                    f"the prompt ({len(prompt)} tokens)"
                )
            if has_state(self.groups) and num_tokens == len(prompt):
                raise ValueError(
                    f"the prefill staged all {num_tokens} prompt tokens; a model with "
                    "Mamba layers needs it to stop at least one token short"
                )
            if prompt_hash(prompt[:num_tokens]) != parsed.prompt_hash:
                raise ValueError(
                    "kv_transfer_params were staged for another prompt (prompt_hash differs)"
                )
            remote = parsed  # only a ticket that checks out is used, renewed or released
            self._renewer.want(request.request_id, remote)
        except ValueError as exc:
            # Still claim the tokens: the worker reports their blocks as load errors, so
            # vLLM's kv_load_failure_policy decides, as for every other failed load.
            error = f"request {request.request_id}: {exc}"
            num_tokens = len(request.prompt_token_ids or ())
        count = tokens_to_load(num_tokens, self.groups) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[request.request_id] = (num_computed_tokens, remote, error)
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode") and self.is_producer:
            self.handoffs.will_save(request)
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens == 0:
            return
        first_token, remote, error = matched
        params["do_remote_prefill"] = False  # load once, even if rescheduled
        starts = load_starts(self.groups, first_token + num_external_tokens, first_token)
        if remote is not None and error is None:
            gap = staging_gap(starts, remote.group_starts or (0,) * len(self.groups))
            error = f"request {request.request_id}: {gap}" if gap else None
        self._pending_loads[request.request_id] = LoadSpec(
            request.request_id,
            tuple(list(ids) for ids in blocks.get_block_ids()),
            first_token,
            remote,
            error,
            self._renewer.holds_until(request.request_id),
            starts,
            first_token + num_external_tokens,
        )

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self.handoffs.kv_cache_manager = manager

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> QAICConnectorMetadata:
        self.releases.expire()
        released = self.handoffs.released_direct()  # before drain_freed
        meta = QAICConnectorMetadata(
            saves=self.handoffs.saves_for_step(scheduler_output),
            loads=list(self._pending_loads.values()),
            invalidate=self.pool.drain_freed(),
            await_saves=self.handoffs.take_await_saves(),
            release_direct=released,
        )
        self._loading.update(self._pending_loads)
        self._pending_loads.clear()
        return meta

    def update_connector_output(
        self, finished_recving: set[str] | None, acks: list[ReleaseRequest]
    ) -> None:
        self._loading.difference_update(finished_recving or ())
        for rid in finished_recving or ():
            self._renewer.drop(rid)
        for ack in acks:  # acknowledgements that came with NIXL reads
            for rid in ack.request_ids:
                self.releases.acknowledge(rid, ack, self._ranks)

    def request_finished(self, request: Request) -> tuple[bool, Any]:
        rid = request.request_id
        self._matched.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._renewer.drop(rid)
        return self.handoffs.finished(request, loading=rid in self._loading)

    def pool_stats(self) -> QAICConnectorStats:
        stats = QAICConnectorStats()
        stats.set("staging_pages_in_use", self.pool.pages_in_use)
        stats.set("staging_pages_total", self.pool.num_pages)
        stats.add("lease_expiries", self.releases.take_expired())
        stats.add("handshakes", self.peers.take_handshakes())
        return stats

    def shutdown(self) -> None:
        self._renewer.close()
        self._server.close()
