"""The scheduler half: logical block ids, request states, kv_transfer_params, leases,
and the side-channel listener. It holds no tensors, layouts or transports."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from vllm_qaic_connector.config import ConnectorConfig, is_loopback
from vllm_qaic_connector.kv_groups import (
    attention_spec,
    groups_of,
    has_state,
    held_start,
    layer_groups,
    layer_starts,
    load_starts,
    ordered_layers,
    staged_starts,
    staging_gap,
    state_bytes,
    tokens_to_load,
)
from vllm_qaic_connector.layout import KVGeometry, StagingFormat, blocks_for_tokens
from vllm_qaic_connector.lease_renewal import LeaseRenewer
from vllm_qaic_connector.peers import PeerDirectory
from vllm_qaic_connector.side_channel import SideChannelServer
from vllm_qaic_connector.staging import StagingPool
from vllm_qaic_connector.stats import QAICConnectorStats
from vllm_qaic_connector.tickets import HEADER_BYTES, Generations, prompt_hash
from vllm_qaic_connector.tp_mapping import reads_needed, source_ranks
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
    direct_problem,
    parse_remote_prefill,
    ticket_mac,
    ticket_problem,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # inside vLLM's logger tree, so it is printed
MAX_TP = 1024  # bounds the work an acknowledgement can ask for


@dataclass(frozen=True)
class SaveSpec:
    """Stage tokens ``[starts[g], num_tokens)`` of each KV cache group ``g``, held in
    ``block_ids[g]``, at ``staging_offset``, laid out as ``layout_kind`` blocks of
    ``block_size`` tokens (the decode's, when it is known), under a header holding
    ``generation``. A chunked prompt is staged chunk by chunk as it is computed (a
    sliding-window group drops its early blocks before the prompt ends): this save
    copies tokens ``[first, last)`` of that range, and only the last one (generation set)
    seals the header."""

    request_id: str
    block_ids: tuple[list[int], ...]
    num_tokens: int
    staging_offset: int
    layout_kind: str
    block_size: int
    generation: int
    starts: tuple[int, ...] = (0,)
    first: int = 0
    last: int = 0  # 0: num_tokens
    direct: bool = False  # nothing to copy: the decode reads block_ids out of our cache


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens ``[starts[g], remote.num_tokens)`` of each KV cache group ``g`` into
    ``block_ids[g]`` (which cover the request from token 0). ``first_token`` is the first
    one not computed here. ``error`` set means: fail the load, report the blocks."""

    request_id: str
    block_ids: tuple[list[int], ...]
    first_token: int
    remote: RemotePrefill | None
    error: str | None = None
    holds_until: float = 0.0  # unix time the staging lease is known to hold (0: unchecked)
    starts: tuple[int, ...] = ()  # empty: first_token for every group
    claimed: int = 0  # tokens claimed from the prefill (0: all it staged)

    def start(self, group: int) -> int:
        return self.starts[group] if self.starts else self.first_token

    @property
    def end(self) -> int:
        return self.claimed or (self.remote.num_tokens if self.remote else 0)


@dataclass
class QAICConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # Staged regions given up (released, expired) whose headers the worker invalidates.
    invalidate: list[int] = field(default_factory=list)
    # Finished requests whose blocks vLLM holds until the worker's saves from them are
    # done: the worker reports each as finished sending then.
    await_saves: list[str] = field(default_factory=list)
    # Requests handed off directly whose tickets are gone: the worker reports them finished
    # sending (vLLM frees their blocks) after it invalidated this step's ``invalidate``.
    release_direct: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StagingTarget:
    """The physical format a request is staged in."""

    layout_kind: str
    block_size: int
    direct: bool = False  # the decode reads our KV cache: nothing is staged


@dataclass
class _Outgoing:
    """A prefill request on its way to a decode."""

    waiting_since: float
    target: StagingTarget | None = None
    offset: int | None = None
    generation: int = 0
    error: str | None = None
    starts: tuple[int, ...] | None = None  # first staged token per group, fixed at its first save
    saved_to: int = 0  # tokens staged so far


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
        self.block_size = spec.block_size
        self.geometry = KVGeometry(
            spec.num_kv_heads,  # type: ignore[attr-defined]
            spec.head_size,  # type: ignore[attr-defined]
            spec.block_size,
            spec.dtype,  # type: ignore[attr-defined]
        )
        self.layer_groups = layer_groups(self.groups, ordered_layers(self.groups))
        self.pool = StagingPool(cfg.num_staging_pages, cfg.staging_page_bytes, cfg.lease_s)
        self._ranks: list[RankMetadata] = []
        self._kv_cache_manager: KVCacheManager | None = None
        self._to_save: dict[str, Request] = {}
        self._staged: dict[str, SaveSpec] = {}
        self._matched: dict[str, tuple[int, RemotePrefill | None, str | None]] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._loading: set[str] = set()  # loads handed to the worker, not yet reported done
        self._outgoing: dict[str, _Outgoing] = {}
        self._await_saves: list[str] = []  # finished, blocks held for the worker's saves
        self._direct_held: dict[str, int] = {}  # handed off directly: blocks held, by request
        # Held blocks shrink the prefill's KV cache: past half of it, requests stage instead.
        self._direct_cap = kv_cache_config.num_blocks // 2
        # (decode rank, prefill rank) reads acknowledged, per staged request
        self._acks: dict[str, set[tuple[int, int]]] = {}
        self._acks_lock = threading.Lock()
        self._generations = Generations()
        self._key = cfg.shared_key
        self._renewer = LeaseRenewer(self._key, cfg.handshake_timeout_s)
        self.peers = PeerDirectory(self.engine_id, self._key, cfg.handshake_timeout_s)
        self._expired = 0  # leases expired since the last pool_stats()
        self._server = SideChannelServer(
            cfg.side_channel_host, cfg.side_channel_port, self._handle, self._key
        )
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
                self._acknowledge(rid, msg)
            self._expire_leases()
            return Ok()
        if isinstance(msg, RenewRequest):
            return Renewed([rid for rid in msg.request_ids if self.pool.renew(rid)])
        return ErrorReply(f"unexpected message {type(msg).__name__}")

    def _expire_leases(self) -> None:
        for rid in self.pool.expire():
            self._expired += 1
            with self._acks_lock:
                self._acks.pop(rid, None)
            logger.warning("QAICConnector: staging lease of request %s expired", rid)

    def _acknowledge(self, rid: str, ack: ReleaseRequest) -> None:
        """Frees the staging once every (decode rank, prefill rank) read is done: each
        prefill rank staged its own heads, and TP decode ranks read at their own pace."""
        total_heads = self._ranks[0].num_kv_heads if self._ranks else 1
        src_tp = max(len(self._ranks), 1)
        if not self.pool.has(rid) or not 0 <= ack.reader_rank < ack.reader_tp <= MAX_TP:
            return  # nothing staged under that id (any more), or a nonsense reader
        try:
            state = has_state(self.groups)  # its shards add reads across TP sizes
            needed = reads_needed(total_heads, src_tp, ack.reader_tp, state)
            sources = ack.source_ranks
            if sources is None:
                sources = source_ranks(total_heads, src_tp, ack.reader_tp, ack.reader_rank, state)
        except ValueError as exc:
            logger.warning("QAICConnector: ignoring acknowledgement of %s: %s", rid, exc)
            return
        with self._acks_lock:
            done = self._acks.setdefault(rid, set())
            done.update((ack.reader_rank, s) for s in sources)
            if not needed <= done:
                return
            del self._acks[rid]
        self.pool.release(rid)

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
            return self._admit_producer(request, params)
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
            self._to_save[request.request_id] = request
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

    # --- prefill side: saves --------------------------------------------------------------

    def _admit_producer(self, request: Request, params: dict[str, Any]) -> tuple[int | None, bool]:
        """Before the prompt runs: learn the decode's format, then reserve staging. Either
        may wait (None: vLLM asks again next step, other requests go on), each bounded."""
        rid, now = request.request_id, time.monotonic()
        out = self._outgoing.setdefault(rid, _Outgoing(waiting_since=now))
        if out.offset is not None or out.error is not None:
            return 0, False
        if out.target is None:
            target = self._resolve_target(rid, params, out.waiting_since)
            if target is None:
                return None, False
            held_blocks = sum(self._direct_held.values())
            if held_blocks + request.num_prompt_tokens // self.block_size > self._direct_cap:
                target = dataclasses.replace(target, direct=False)
            out.target, out.waiting_since = target, now
        held = (0,) * len(self.groups)  # the most it can stage: nothing is dropped yet
        fmt = self._staging_format(request.num_prompt_tokens, out.target, held)
        self._expire_leases()  # an idle engine ran no step that would have freed them
        try:
            kv_bytes = 0 if out.target.direct else fmt.request_bytes(request.num_prompt_tokens)
            offset = self.pool.allocate(rid, HEADER_BYTES + kv_bytes)
        except ValueError as exc:
            out.error = str(exc)
            return 0, False
        if offset is None:
            if now - out.waiting_since < self.cfg.staging_wait_s:
                return None, False  # back-pressure: wait for pages to come back
            out.error = (
                f"staging pool full ({self.pool.pages_in_use}/{self.pool.num_pages} pages) "
                f"for {self.cfg.staging_wait_s}s; raise staging_bytes or lower the load"
            )
            logger.warning("QAICConnector: request %s: %s", rid, out.error)
            return 0, False
        out.offset, out.generation = offset, self._generations.take()
        return 0, False

    def _resolve_target(
        self, rid: str, params: dict[str, Any], since: float
    ) -> StagingTarget | None:
        """The named decode's format; our own if none is named or it cannot be reached in
        time (the decode then converts on receive), or where it reads our cache directly
        (it converts as it copies). None while the handshake is pending."""
        own = StagingTarget(self._ranks[0].layout_kind if self._ranks else "", self.block_size)
        host, port = params.get("decode_host"), params.get("decode_port")
        if host is None and port is None:
            return own
        if not isinstance(host, str) or not isinstance(port, int):
            logger.error(
                "QAICConnector: request %s: malformed decode_host/decode_port in "
                "kv_transfer_params; staging in our own layout",
                rid,
            )
            return own
        found = self.peers.poll(host, port)
        if found is None:
            if time.monotonic() - since < self.cfg.handshake_timeout_s:
                return None
            found = f"handshake with {host}:{port} timed out"
        if isinstance(found, str):
            logger.warning("QAICConnector: request %s: %s; staging in our own layout", rid, found)
            return own
        if len(found) != len(self._ranks):
            return own  # head shards differ: the decode regroups heads on receive
        if not direct_problem(self._ranks[0], found[0], len(self._ranks)):
            return dataclasses.replace(own, direct=True)  # block_ids: ours, in our format
        return StagingTarget(found[0].layout_kind, found[0].block_size)

    def _staging_format(
        self, num_tokens: int, target: StagingTarget, held: tuple[int, ...]
    ) -> StagingFormat:
        starts = staged_starts(self.groups, num_tokens, target.block_size, held)
        return StagingFormat(
            target.layout_kind,
            dataclasses.replace(self.geometry, block_size=target.block_size),
            len(self.layer_groups),
            layer_starts(starts, self.layer_groups, len(self.layer_groups)),
            state_bytes(self.groups),
        )

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    def _saves_for_step(self, out: SchedulerOutput) -> list[SaveSpec]:
        saves = []
        for rid, req in list(self._to_save.items()):
            scheduled = out.num_scheduled_tokens.get(rid, 0)
            if scheduled == 0:
                continue
            # build_connector_meta runs before the scheduler advances num_computed_tokens.
            last = min(req.num_computed_tokens + scheduled, req.num_prompt_tokens)
            final = last >= req.num_prompt_tokens
            if final:
                del self._to_save[rid]
            outgoing = self._outgoing.get(rid)
            if outgoing is None or outgoing.offset is None or outgoing.target is None:
                continue  # no staging (its error travels back in request_finished)
            if not self.pool.renew(rid):
                outgoing.error = "staging lease expired before the prompt finished"
                self._to_save.pop(rid, None)
                continue
            spec = self._save_spec(req, outgoing, last, final)
            outgoing.saved_to = last
            if final:
                self._staged[rid] = spec
            saves.append(spec)
        return saves

    def _save_spec(self, req: Request, out: _Outgoing, last: int, final: bool) -> SaveSpec:
        assert self._kv_cache_manager is not None and out.offset is not None
        assert out.target is not None
        num_tokens = req.num_prompt_tokens
        block_ids = tuple(
            list(ids[: blocks_for_tokens(num_tokens, g.block_size)])
            for g, ids in zip(
                self.groups, self._kv_cache_manager.get_block_ids(req.request_id), strict=True
            )
        )
        if out.starts is None:
            null = self._kv_cache_manager.block_pool.null_block.block_id
            held = tuple(
                held_start(ids, null, g.block_size)
                for g, ids in zip(self.groups, block_ids, strict=True)
            )
            out.starts = staged_starts(self.groups, num_tokens, out.target.block_size, held)
        return SaveSpec(
            req.request_id,
            block_ids,
            num_tokens,
            out.offset,
            out.target.layout_kind,
            out.target.block_size,
            out.generation if final else 0,
            out.starts,
            out.saved_to,
            last,
            out.target.direct,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> QAICConnectorMetadata:
        self._expire_leases()
        # Before drain_freed: a released ticket is invalidated no later than its blocks go.
        released = [rid for rid in self._direct_held if not self.pool.has(rid)]
        for rid in released:
            del self._direct_held[rid]
        meta = QAICConnectorMetadata(
            saves=self._saves_for_step(scheduler_output),
            loads=list(self._pending_loads.values()),
            invalidate=self.pool.drain_freed(),
            await_saves=self._await_saves,
            release_direct=released,
        )
        self._await_saves = []
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
                self._acknowledge(rid, ack)

    def request_finished(self, request: Request) -> tuple[bool, Any]:
        rid = request.request_id
        self._to_save.pop(rid, None)
        self._matched.pop(rid, None)
        out = self._outgoing.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._renewer.drop(rid)
        if rid in self._loading:
            # Aborted mid-load: the worker may still write these blocks. vLLM frees them
            # when the worker reports the load finished.
            return True, None
        # Saves run on the worker's own thread, after the step: the blocks they read stay
        # held until the worker reports them finished sending.
        direct = out is not None and out.target is not None and out.target.direct
        hold = self.cfg.async_saves and out is not None and out.saved_to > 0 and not direct
        if hold:
            self._await_saves.append(rid)
        spec = self._staged.pop(rid, None)
        if spec is None:
            self.pool.release(rid)  # reserved, never (wholly) staged
            if out is not None and out.error is not None:
                return hold, {"do_remote_prefill": False, "error": out.error}
            return hold, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            self.pool.release(rid)  # aborted: nobody will come for it
            return hold, None
        params = RemotePrefill(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_host=self.cfg.advertise_host,
            remote_port=self._server.port,
            remote_request_id=rid,
            num_tokens=spec.num_tokens,
            staging_offset=spec.staging_offset,
            staged_layout=spec.layout_kind,
            staged_block_size=spec.block_size,
            incarnation=self._ranks[0].incarnation if self._ranks else "",
            generation=spec.generation,
            prompt_hash=prompt_hash((request.prompt_token_ids or [])[: spec.num_tokens]),
            lease_s=self.cfg.lease_s,
            expires_at=time.time() + self.pool.expires_in(rid),
            group_starts=spec.starts if any(spec.starts) else (),
            block_ids=tuple(spec.block_ids[0]) if spec.direct else (),
        )
        if self._key is not None:
            params = msgspec.structs.replace(params, ticket_mac=ticket_mac(params, self._key))
        if spec.direct:  # its blocks are the KV: held until the lease is released or ends
            self._direct_held[rid] = len(spec.block_ids[0])
            hold = True
        return hold, msgspec.to_builtins(params)

    def pool_stats(self) -> QAICConnectorStats:
        stats = QAICConnectorStats()
        stats.set("staging_pages_in_use", self.pool.pages_in_use)
        stats.set("staging_pages_total", self.pool.num_pages)
        stats.add("lease_expiries", self._expired)
        stats.add("handshakes", self.peers.take_handshakes())
        self._expired = 0
        return stats

    def shutdown(self) -> None:
        self._renewer.close()
        self._server.close()
