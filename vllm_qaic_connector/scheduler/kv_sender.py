"""What leaves this engine, in the scheduler (SGLang's ``KVSender``): a prefill's requests
on their way to decodes (the decode's format learnt by handshake, staging reserved before
the prompt runs, a save per computed chunk, the ticket when the request finishes; its
staging is freed by `staging_releases`), and the blocks held for readers: a direct
handoff's until its ticket is gone, and those of a decode's `kept_turns`, which leave the
same way. Logical only: no tensors, layouts or transports."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.v1.request import RequestStatus

from vllm_qaic_connector.config import ConnectorConfig
from vllm_qaic_connector.kv.kv_groups import (
    KVGroup,
    held_start,
    layer_groups,
    ordered_layers,
    staged_starts,
)
from vllm_qaic_connector.kv.staging_target import StagingTarget
from vllm_qaic_connector.layout import KVGeometry, blocks_for_tokens
from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.model_weights import adapter_fingerprint
from vllm_qaic_connector.protocol.peers import PeerDirectory
from vllm_qaic_connector.protocol.routed_params import RoutedParams
from vllm_qaic_connector.protocol.ticket import (
    RemotePrefill,
    block_chain,
    prompt_hash,
    ticket_binding,
    ticket_mac,
)
from vllm_qaic_connector.protocol.wire import RankMetadata
from vllm_qaic_connector.region_headers import HEADER_BYTES, generations
from vllm_qaic_connector.scheduler import request_ids
from vllm_qaic_connector.scheduler.staging_releases import StagingReleases
from vllm_qaic_connector.stats import QAICConnectorStats
from vllm_qaic_connector.step_metadata import SaveSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)
FINISHED = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)  # not aborted


def _unreturnable(rid: str) -> str | None:
    if request_ids.sampling_child(rid):
        return "n > 1 with do_remote_decode is not supported: send n = 1 per request"
    if position := request_ids.later_prompt_of_a_list(rid):
        return (
            f"prompt {position} of a prompt list is not staged: vLLM returns the first "
            "prompt's kv_transfer_params only (send one prompt per request)"
        )
    return None


@dataclasses.dataclass
class _Outgoing:
    """A prefill request on its way to a decode."""

    waiting_since: float
    target: StagingTarget | None = None
    offset: int | None = None
    generation: int = 0
    error: str | None = None
    starts: tuple[int, ...] | None = None  # first staged token per group, fixed at its first save
    saved_to: int = 0  # tokens staged so far
    request: Request | None = None  # blocks allocated, and the prompt not all saved yet
    staged: SaveSpec | None = None  # its last save, which seals the ticket's header


@dataclasses.dataclass(frozen=True)
class LocalEngine:
    """The facts about this prefill engine that a handoff needs."""

    engine_id: str
    groups: tuple[KVGroup, ...]
    geometry: KVGeometry
    num_blocks: int  # in its KV cache
    port: int  # its side channel's, named in tickets
    # The server's cap on an answer's tokens (its generation config; `answer_cap`).
    max_tokens_cap: int | None = None


def answer_cap(model_config: Any) -> int | None:
    """What vLLM's OpenAI server caps an answer at whatever the client asks (the
    ``override_max_tokens`` of its ``get_max_tokens``): max_new_tokens of
    --override-generation-config, or of a generation config that is neither vLLM's nor
    the model's own. A router that hands the client the prefill's token needs it to end
    the answer where vLLM would."""
    if model_config.generation_config not in ("auto", "vllm"):
        return model_config.get_diff_sampling_param().get("max_tokens")
    override = getattr(model_config, "override_generation_config", None) or {}
    return override.get("max_new_tokens")


class KVSender:
    def __init__(
        self,
        cfg: ConnectorConfig,
        engine: LocalEngine,
        releases: StagingReleases,
        peers: PeerDirectory,
    ) -> None:
        self.cfg, self.engine, self.releases, self.peers = cfg, engine, releases, peers
        self.pool = releases.pool
        self.ranks: list[RankMetadata] = []  # our workers', by TP rank
        self.kv_cache_manager: KVCacheManager | None = None
        self._layer_groups = layer_groups(engine.groups, ordered_layers(engine.groups))
        self._outgoing: dict[str, _Outgoing] = {}
        self._await_saves: list[str] = []  # finished, blocks held for the worker's saves
        # Blocks held for readers, by request: direct handoffs' and kept turns'. They shrink
        # the KV cache: past half of it, requests stage instead and turns are not kept.
        self.held: dict[str, int] = {}
        self.held_cap = engine.num_blocks // 2
        self._named_at: dict[str, float] = {}  # decodes requests named, when last
        self._generations = generations()
        self.stats = QAICConnectorStats()  # counters, taken by the scheduler side's stats
        for host, port in cfg.decode_sides:  # handshaken now, so the first request finds them
            peers.poll(host, port)

    # --- before the prompt runs ----------------------------------------------------------

    def admit(self, request: Request, routed: RoutedParams) -> tuple[int | None, bool]:
        """Learn the decode's format, then reserve staging. Either may wait (None: vLLM
        asks again next step, other requests go on), each bounded."""
        rid, now = request.request_id, time.monotonic()
        holder = f"{routed.decode_host}:{routed.decode_port}" if routed.decode_host else ""
        out = self._outgoing.setdefault(rid, _Outgoing(waiting_since=now))
        if out.target is None and out.error is None:
            # Malformed params, or a ticket that could never reach a decode.
            out.error = routed.error or _unreturnable(rid)
            if out.error:
                logger.error("QAICConnector: request %s: %s", rid, out.error)
        if out.offset is not None or out.error is not None:
            return 0, False
        if out.target is None:
            if (target := self._resolve_target(rid, routed, out.waiting_since)) is None:
                return None, False
            wanted = request.num_prompt_tokens // self.engine.geometry.block_size
            if sum(self.held.values()) + wanted > self.held_cap:
                target = dataclasses.replace(target, direct=False)
            out.target, out.waiting_since = target, now
        fmt = out.target.largest_format(
            request.num_prompt_tokens, self.engine.geometry, self.engine.groups, self._layer_groups
        )
        self.releases.expire()  # an idle engine ran no step that would have freed them
        quota = self._quota(holder, now)
        try:
            kv_bytes = 0 if out.target.direct else fmt.request_bytes(request.num_prompt_tokens)
            offset = self.pool.allocate(rid, HEADER_BYTES + kv_bytes, holder=holder, quota=quota)
        except ValueError as exc:
            out.error = str(exc)
            return 0, False
        if offset is None:
            if now - out.waiting_since < self.cfg.staging_wait_s:
                return None, False  # back-pressure: wait for pages to come back
            out.error = self._no_pages(holder, quota, HEADER_BYTES + kv_bytes)
            logger.warning("QAICConnector: request %s: %s", rid, out.error)
            return 0, False
        out.offset, out.generation = offset, next(self._generations)
        return 0, False

    def _quota(self, holder: str, now: float) -> int | None:
        """The most staging pages a named decode may hold while another decode was named
        within a lease (or is in ``decode_peers``): a slow or dead one then cannot take
        every page from healthy ones. Alone, or not named (a router that names none), a
        decode may use the whole pool."""
        if not holder or self.cfg.decode_staging_share >= 1:
            return None
        self._named_at[holder] = now
        self._named_at = {d: t for d, t in self._named_at.items() if now - t < self.cfg.lease_s}
        if len(self._named_at.keys() | self.cfg.decode_peers) < 2:
            return None
        return max(1, int(self.pool.num_pages * self.cfg.decode_staging_share))

    def _no_pages(self, holder: str, quota: int | None, num_bytes: int) -> str:
        held, total = self.pool.pages_held_by(holder), self.pool.num_pages
        wait_s = self.cfg.staging_wait_s
        if quota is not None and held + self.pool.pages_for(num_bytes) > quota:
            return (
                f"decode {holder} held its share of staging ({held}/{total} pages, "
                f"decode_staging_share {self.cfg.decode_staging_share}) for {wait_s}s: "
                "it reads slowly or not at all"
            )
        return (
            f"staging pool full ({self.pool.pages_in_use}/{total} pages) for {wait_s}s; "
            "raise staging_bytes or lower the load"
        )

    def will_save(self, request: Request) -> None:
        """Its blocks are allocated: save each chunk as it is computed."""
        if (out := self._outgoing.get(request.request_id)) is not None:
            out.request = request

    def _resolve_target(self, rid: str, routed: RoutedParams, since: float) -> StagingTarget | None:
        """The named decode's format, else the one every decode in ``decode_peers`` takes;
        our own where they differ, none is known or the named one cannot be reached in time
        (the decode then converts on receive), or where it reads our cache directly (it
        converts as it copies). None while the named decode's handshake is pending."""
        own_kind = self.ranks[0].layout_kind if self.ranks else ""
        own = StagingTarget(own_kind, self.engine.geometry.block_size)
        host, port = routed.decode_host, routed.decode_port
        if not host:  # a router that names no decode: our fleet's
            known = [self.peers.poll(h, p) for h, p in self.cfg.decode_sides]
            targets = {
                StagingTarget.for_decode(self.ranks, f, own) if isinstance(f, list) else own
                for f in known
            }
            return targets.pop() if len(targets) == 1 else own
        found = self.peers.poll(host, port)
        if found is None:
            if time.monotonic() - since < self.cfg.handshake_timeout_s:
                return None
            found = f"handshake with {host}:{port} timed out"
        if isinstance(found, str):
            logger.warning("QAICConnector: request %s: %s; staging in our own layout", rid, found)
            return own
        return StagingTarget.for_decode(self.ranks, found, own)

    # --- each step ----------------------------------------------------------------------

    def saves_for_step(self, out: SchedulerOutput) -> list[SaveSpec]:
        saves = []
        for rid, outgoing in self._outgoing.items():
            req, scheduled = outgoing.request, out.num_scheduled_tokens.get(rid, 0)
            if req is None or scheduled == 0:
                continue
            # build_connector_meta runs before the scheduler advances num_computed_tokens.
            last = min(req.num_computed_tokens + scheduled, req.num_prompt_tokens)
            final = last >= req.num_prompt_tokens
            if final:
                outgoing.request = None
            if outgoing.offset is None or outgoing.target is None:
                continue  # no staging (its error travels back in finished())
            if not self.pool.renew(rid):
                outgoing.error = "staging lease expired before the prompt finished"
                outgoing.request = None
                continue
            spec = self._save_spec(req, outgoing, last, final)
            outgoing.saved_to = max(outgoing.saved_to, last)  # a preempted one recomputes
            if final:
                outgoing.staged = spec
            saves.append(spec)
        return saves

    def preempted(self, out: SchedulerOutput) -> list[str]:
        """Requests preempted this step that have saved chunks, so a save may still be
        reading blocks vLLM just freed."""
        preempted = out.preempted_req_ids or set()
        ours = sorted(r for r in preempted if (o := self._outgoing.get(r)) and o.saved_to)
        self.stats.add("preempted_handoffs", len(ours))
        return ours

    def _save_spec(self, req: Request, out: _Outgoing, last: int, final: bool) -> SaveSpec:
        assert self.kv_cache_manager is not None and out.offset is not None
        assert out.target is not None
        groups, num_tokens = self.engine.groups, req.num_prompt_tokens
        all_ids = self.kv_cache_manager.get_block_ids(req.request_id)
        block_ids = tuple(
            list(ids[: blocks_for_tokens(num_tokens, g.block_size)])
            for g, ids in zip(groups, all_ids, strict=True)
        )
        if out.starts is None:
            null = self.kv_cache_manager.block_pool.null_block.block_id
            held = tuple(
                held_start(ids, null, g.block_size)
                for g, ids in zip(groups, block_ids, strict=True)
            )
            out.starts = staged_starts(groups, num_tokens, out.target.block_size, held)
        spec = SaveSpec(
            request_id=req.request_id,
            block_ids=block_ids,
            num_tokens=num_tokens,
            staging_offset=out.offset,
            layout_kind=out.target.layout_kind,
            block_size=out.target.block_size,
            generation=out.generation if final else 0,
            starts=out.starts,
            first=out.saved_to,
            last=last,
            direct=out.target.direct,
        )
        if not final:
            return spec
        return dataclasses.replace(spec, binding=ticket_binding(self.ticket(req, spec)))

    def take_await_saves(self) -> list[str]:
        taken, self._await_saves = self._await_saves, []
        return taken

    def released_direct(self) -> list[str]:
        """Direct handoffs whose tickets are gone (released, expired): their blocks may go.
        Run before the pool's drain_freed, so a ticket is invalidated no later than its
        blocks are freed."""
        released = [rid for rid in self.held if not self.pool.has(rid)]
        for rid in released:
            del self.held[rid]
        return released

    # --- when the request finishes --------------------------------------------------------

    def outgoing(self, request_id: str) -> bool:
        """Whether the request is on its way to a decode (``do_remote_decode``)."""
        return request_id in self._outgoing

    def finished(self, request: Request, loading: bool) -> tuple[bool, Any]:
        """`request_finished` for a prefill: whether vLLM holds its blocks, and the ticket a
        decode loads with (or the error that kept it from staging). ``loading``: it is
        still loading KV of its own, so its blocks stay held and nothing is handed off."""
        rid = request.request_id
        out = self._outgoing.pop(rid, None)
        if loading:
            # Aborted mid-load: the worker may still write these blocks. vLLM frees them
            # when the worker reports the load finished.
            return True, None
        if out is None:
            return False, None
        # Saves run on the worker's own thread, after the step: the blocks they read stay
        # held until the worker reports them finished sending.
        direct = out.target is not None and out.target.direct
        hold = self.cfg.async_saves and out.saved_to > 0 and not direct
        if hold:
            self._await_saves.append(rid)
        # Reserved, never (wholly) staged; or aborted: nobody will come for it. Never
        # reserved (an error): any staging under its id is an earlier request's.
        if (spec := out.staged) is None or request.status not in FINISHED:
            if out.offset is not None:
                self.pool.release(rid)
            error = out.error if spec is None else None
            return hold, None if error is None else {"do_remote_prefill": False, "error": error}
        # The lease runs from the hand-out: nobody could read the ticket before, and the
        # step may have been long (vLLM compiles its logprob kernel at a server's first
        # logprobs request: 11 s here, which spent a 2 s lease before the ticket was out).
        self.pool.renew(rid)
        if spec.direct:  # its blocks are the KV: held until the lease is released or ends
            self.held[rid] = len(spec.block_ids[0])
            hold = True
        return hold, msgspec.to_builtins(self.ticket(request, spec))

    def ticket(self, request: Request, spec: SaveSpec, turn: bool = False) -> RemotePrefill:
        """The ticket for ``spec``'s KV (vLLM hands it back as ``kv_transfer_params``); a
        kept ``turn``'s with its `block_chain`."""
        # A kept turn's tokens run on into the answer's; prompt embeddings have none.
        tokens = request.all_token_ids if request.prompt_token_ids is not None else []
        params = RemotePrefill(
            do_remote_prefill=True,
            remote_engine_id=self.engine.engine_id,
            remote_host=self.cfg.advertise_host,
            remote_port=self.engine.port,
            remote_request_id=request.request_id,
            num_tokens=spec.num_tokens,
            staging_offset=spec.staging_offset,
            staged_layout=spec.layout_kind,
            staged_block_size=spec.block_size,
            incarnation=self.ranks[0].incarnation if self.ranks else "",
            generation=spec.generation,
            prompt_hash=prompt_hash(tokens[: spec.num_tokens]),
            adapter=adapter_fingerprint(request.lora_request),
            lease_s=round(self.cfg.lease_s, 3),  # whole ms: see ticket_mac
            expires_at=round(time.time() + self.pool.expires_in(request.request_id), 3),
            group_starts=spec.starts if any(spec.starts) else (),
            block_ids=tuple(spec.block_ids[0]) if spec.direct else (),
            max_tokens_cap=self.engine.max_tokens_cap,
            block_hashes=block_chain(tokens[: spec.num_tokens], spec.block_size) if turn else (),
        )
        if (key := self.cfg.shared_key) is not None:
            params = msgspec.structs.replace(params, ticket_mac=ticket_mac(params, key))
        return params
