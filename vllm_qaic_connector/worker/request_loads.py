"""One request's load: its prompt's KV from the prefill into our blocks, out of staging
(ticket-checked reads of each source rank's heads) or straight out of the prefill's cache."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from vllm_qaic_connector.config import ConnectorConfig
from vllm_qaic_connector.kv.copy_pool import CopyPool
from vllm_qaic_connector.kv.token_copies import layer_runs
from vllm_qaic_connector.kv.tp_mapping import head_sources, heads_of_rank, source_ranks
from vllm_qaic_connector.layout import KVGeometry, blocks_for_tokens, get_layout
from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.peers import PeerDirectory
from vllm_qaic_connector.protocol.ticket import ticket_binding
from vllm_qaic_connector.protocol.wire import RankMetadata, ack_message, direct_problem
from vllm_qaic_connector.region_headers import StaleTicket, checked_read
from vllm_qaic_connector.step_metadata import LoadSpec
from vllm_qaic_connector.transports import KVTransport
from vllm_qaic_connector.worker.direct_reads import (
    DirectReader,
    cache_endpoint,
    owner_of,
    plan_cache_reads,
)
from vllm_qaic_connector.worker.loader import WriteGate
from vllm_qaic_connector.worker.registration import LocalCache


@dataclasses.dataclass(frozen=True)
class LoadResult:
    request_id: str
    failed_blocks: frozenset[int]
    tokens: int
    bytes_copied: int
    source_engine: str
    seconds: float = 0.0  # from the load's start to its KV in our blocks
    read_seconds: float = 0.0  # of which in transport reads (over shm none: the copy reads)
    reads: int = 0  # transport reads (NIXL descriptors), ticket headers included
    direct: bool = False  # copied out of the prefill's KV cache, not out of staging


logger = get_logger(__name__)


class RequestLoads:
    """Runs on the `Loader`'s threads; ``failed`` also on the engine's."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        cache: LocalCache,
        ours: RankMetadata,  # this rank's handshake: its TP place, the model's KV heads
        transport: KVTransport,
        peers: PeerDirectory,
        direct: DirectReader,
        copies: CopyPool,
    ) -> None:
        self.cfg, self.cache, self.ours = cfg, cache, ours
        self.transport, self.peers, self.direct, self.copies = transport, peers, direct, copies
        self._tp = ours.tp_size, ours.tp_rank
        self._key = cfg.shared_key  # read once: the property reads the key file each time
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="qaic-kv-release")

    def load(self, spec: LoadSpec, gate: WriteGate) -> LoadResult:
        if spec.error is not None or spec.remote is None:
            raise ValueError(spec.error or "no remote prefill")
        ranks = self._peer_ranks(spec)
        if spec.holds_until and (late := time.time() - spec.holds_until) > 0:
            raise StaleTicket(f"the staging lease ran out {late:.1f}s before the read")
        if spec.remote.block_ids:
            return self._direct(spec, ranks, gate)
        return self._staged(spec, ranks, gate)

    def failed(self, spec: LoadSpec, reason: str) -> LoadResult:
        logger.error("QAICConnector: request %s: KV load failed: %s", spec.request_id, reason)
        # Only to a peer that answered a handshake: a dead one would hold a thread for
        # nothing (its lease frees the pages). Off this thread: it may be the engine's.
        if (remote := spec.remote) and self.peers.answered(remote.remote_host, remote.remote_port):
            self._releaser.submit(self._release_remote, spec)
        source = remote.remote_engine_id if remote else ""
        return LoadResult(spec.request_id, self.blocks_to_load(spec), 0, 0, source)

    def blocks_to_load(self, spec: LoadSpec, group: int | None = None) -> frozenset[int]:
        """The blocks a load writes, in one group or in all of them."""
        bs = self.cache.geometry.block_size
        groups = range(len(spec.block_ids)) if group is None else [group]
        blocks: set[int] = set()
        for g in groups:
            ids = spec.block_ids[g]
            end = spec.end or len(ids) * bs
            blocks.update(ids[spec.start(g) // bs : blocks_for_tokens(end, bs)])
        return frozenset(blocks)

    def shutdown(self) -> None:
        self._releaser.shutdown(wait=False)  # queued releases still go out

    def _peer_ranks(self, spec: LoadSpec) -> list[RankMetadata]:
        """The prefill's ranks as of the ticket's incarnation (`PeerDirectory.staged_by`):
        the handshake this load waited on, or, where it restarted since, a fresh one."""
        assert spec.remote is not None
        return self.peers.staged_by(spec.remote, self._forget_mappings, retry=False)

    def _forget_mappings(self, ranks: list[RankMetadata]) -> None:
        """A restarted peer's old ranks: what we mapped or registered of them goes."""
        for old in ranks:
            self.transport.forget_peer(old.endpoint)
            self.direct.forget(owner_of(old))

    def _staged(self, spec: LoadSpec, ranks: list[RankMetadata], gate: WriteGate) -> LoadResult:
        """Reads each source rank's staged heads (ticket-checked) into our blocks."""
        remote, cache, transport = spec.remote, self.cache, self.transport
        assert remote is not None
        total, src_tp = self.ours.num_kv_heads, len(ranks)
        staged_bs = remote.staged_block_size
        src_blocks = list(range(blocks_for_tokens(remote.num_tokens, staged_bs)))
        copied, reads, read_s, t0 = 0, 0, 0.0, time.monotonic()
        # Each source rank staged its own head shard (and state shard); read only what
        # this rank holds.
        kv_heads = {s.src_rank: s.heads for s in head_sources(total, src_tp, *self._tp)}
        for r in source_ranks(total, src_tp, *self._tp, state=cache.state is not None):
            src_rank = ranks[r]
            heads = len(heads_of_rank(total, src_tp, r))
            src_geo = KVGeometry(heads, src_rank.head_size, staged_bs, cache.geometry.dtype)
            staged = remote.group_starts or (0,) * len(spec.block_ids)
            fmt = cache.staging_format(
                remote.staged_layout, src_geo, src_rank.num_layers, staged, (src_tp, r)
            )
            # The acknowledgement rides on the last read of this source rank, when the
            # transport carries messages; otherwise it goes over the side channel below.
            ack = self._ack(remote.remote_request_id, r)
            nbytes = fmt.request_bytes(remote.num_tokens)
            read = checked_read(
                transport, src_rank.endpoint, remote.staging_offset, nbytes, remote.generation,
                ack, ticket_binding(remote),
            )  # fmt: skip
            t_read = time.monotonic()
            with read as region, gate.writing():
                read_s += time.monotonic() - t_read  # the region's READ, and its header's
                views = fmt.layer_views(region, remote.num_tokens)
                runs = layer_runs(len(views), cache.group, fmt.shift) if r in kv_heads else ()
                for (group, shift), layers in runs:  # none: a rank read for its state
                    t = spec.start(group)
                    copied += self.copies.layers(
                        views[layers], src_blocks, cache.layers[layers], spec.block_ids[group],
                        t - shift, spec.end - shift, kv_heads[r], dst_t0=t,
                    )  # fmt: skip
                if cache.state is not None:
                    region_state = fmt.state_region(region, remote.num_tokens)
                    copied += cache.state.load(region_state, spec.block_ids, src_tp, r)
                if self.cfg.debug_corrupt_loaded_kv:
                    self._corrupt(spec)
            reads += 2  # the region with its header, then the header again
        return self._loaded(spec, ranks[0].engine_id, copied, t0, reads, read_s)

    def _direct(self, spec: LoadSpec, ranks: list[RankMetadata], gate: WriteGate) -> LoadResult:
        """Copies the prompt's blocks out of the prefill rank's KV cache (mapped shm, in
        any layout and block size; or NIXL READs of whole blocks into ours), inside a check of
        the ticket's header-only region."""
        remote, cache, transport = spec.remote, self.cache, self.transport
        assert remote is not None
        tp_rank = self.ours.tp_rank
        src = ranks[tp_rank] if len(ranks) == self.ours.tp_size else None
        problem = direct_problem(src, self.ours, len(ranks)) if src else "TP sizes differ"
        staged = (remote.staged_layout, remote.staged_block_size)
        if problem is None and src is not None and staged != (src.layout_kind, src.block_size):
            problem = "the ticket's format is not the prefill's"  # block_ids are in it
        t0, read_s, bs = time.monotonic(), 0.0, cache.geometry.block_size
        first, end, ours, theirs = spec.start(0), spec.end, spec.block_ids[0], remote.block_ids
        if problem is None and src and src.cache and first % bs and not src.cache.mapped:
            problem = "the first token to load is inside a block"
        if problem is not None or src is None or src.cache is None:
            raise ConnectionError(f"cannot read the prefill's KV cache directly: {problem}")
        if max(remote.block_ids) >= src.num_blocks:
            raise ValueError(f"block_ids beyond the prefill's {src.num_blocks} blocks")
        lo, hi = first // bs, blocks_for_tokens(end, bs)
        ack = self._ack(remote.remote_request_id, tp_rank)
        reads = 2  # the header, before and after
        with (
            checked_read(transport, src.endpoint, remote.staging_offset, 0, remote.generation,
                         ack, ticket_binding(remote)),
            gate.writing(),
        ):  # fmt: skip
            if not src.cache.mapped:  # registered memory: READs of whole blocks
                blocks = (theirs[lo:hi], ours[lo:hi])
                runs = plan_cache_reads(src.cache, cache.layout, cache.tensors, blocks)
                copied = transport.read_into(cache_endpoint(src.endpoint, src.cache), runs)
                read_s = time.monotonic() - t0
                reads += len(runs)
            else:
                geometry = dataclasses.replace(cache.geometry, block_size=src.block_size)
                layout = get_layout(src.layout_kind)
                mapped = self.direct.peer(owner_of(src), src.cache, layout, geometry)
                copied = (
                    self.direct.copy(mapped, theirs[lo:hi], cache.tensors, ours[lo:hi])
                    if (layout, geometry) == (cache.layout, cache.geometry) and not first % bs
                    else self.copies.layers(mapped.layers, theirs, cache.layers, ours, first, end)
                )  # converted, or the first block is partly ours already
            if self.cfg.debug_corrupt_loaded_kv:
                self._corrupt(spec)
        return self._loaded(spec, ranks[0].engine_id, copied, t0, reads, read_s, direct=True)

    def _ack(self, remote_request_id: str, src_rank: int) -> bytes | None:
        """What tells source rank ``src_rank`` that this rank has read its part, riding on
        the read; None where the transport carries no messages."""
        if not self.transport.delivers_notifications:
            return None
        me = self.ours
        return ack_message(remote_request_id, me.tp_rank, me.tp_size, src_rank, self._key)

    def _loaded(
        self, spec: LoadSpec, source: str, copied: int, t0: float, reads: int, read_s: float,
        direct: bool = False,
    ) -> LoadResult:  # fmt: skip
        if not self.transport.delivers_notifications:
            self._releaser.submit(self._release_remote, spec)  # a dead prefill: not our wait
        return LoadResult(
            spec.request_id, frozenset(), spec.end - spec.first_token, copied,
            source, time.monotonic() - t0, read_s, reads, direct,
        )  # fmt: skip

    def _corrupt(self, spec: LoadSpec) -> None:
        """Negative control: zero what was just loaded, so accuracy must collapse."""
        for i, (k, v) in enumerate(self.cache.layers):
            for block in self.blocks_to_load(spec, self.cache.group(i)):
                k[block].zero_()
                v[block].zero_()
        if self.cache.state is not None:
            self.cache.state.zero(spec.block_ids)

    def _release_remote(self, spec: LoadSpec) -> None:
        if spec.remote is not None:
            reader = (self.ours.tp_rank, self.ours.tp_size)
            side_channel.release(spec.remote, self._key, self.cfg.handshake_timeout_s, reader)
