"""The worker half: KV cache registration, handshakes, saves into staging, and loads."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from vllm_qaic_connector import side_channel
from vllm_qaic_connector.config import ConnectorConfig
from vllm_qaic_connector.direct_reads import (
    DirectReader,
    cache_endpoint,
    host_identity,
    owner_of,
    plan_cache_reads,
    register_kv_cache,
    share_kv_cache,
)
from vllm_qaic_connector.kv_groups import (
    KVGroup,
    attention_spec,
    groups_of,
    layer_groups,
    layer_starts,
    ordered_layers,
)
from vllm_qaic_connector.layout import (
    KVGeometry,
    KVLayout,
    StagingFormat,
    blocks_for_tokens,
    copy_tokens,
)
from vllm_qaic_connector.layout_probe import detect_layout
from vllm_qaic_connector.loader import Loader, WriteGate
from vllm_qaic_connector.peers import PeerDirectory
from vllm_qaic_connector.recurrent_state import RecurrentState, mixer_splits
from vllm_qaic_connector.scheduler_side import LoadSpec, QAICConnectorMetadata, SaveSpec
from vllm_qaic_connector.stats import PER_PEER_PREFIX, QAICConnectorStats
from vllm_qaic_connector.tickets import (
    HEADER_BYTES,
    RegionHeaders,
    StaleTicket,
    checked_read,
    checked_region,
    new_incarnation,
)
from vllm_qaic_connector.tp_mapping import head_sources, heads_of_rank, source_ranks
from vllm_qaic_connector.transports import KVTransport, create_transport, staging_name
from vllm_qaic_connector.transports.nixl import NixlTransport
from vllm_qaic_connector.wire import (
    RankMetadata,
    ReleaseRequest,
    RemotePrefill,
    ack_message,
    compat_hash,
    direct_problem,
    parse_ack,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(f"vllm.{__name__}")  # inside vLLM's logger tree, so it is printed

Views = tuple[torch.Tensor, torch.Tensor]
SSM_GROUP_KEYS = ("mamba_n_groups", "n_groups", "mamba_ngroups")  # spellings in HF configs


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


@dataclass(frozen=True)
class LoadResult:
    request_id: str
    failed_blocks: frozenset[int]
    tokens: int
    bytes_copied: int
    source_engine: str
    seconds: float = 0.0  # from the load's start to its KV in our blocks
    reads: int = 0  # transport reads (NIXL descriptors), ticket headers included
    direct: bool = False  # copied out of the prefill's KV cache, not out of staging


@dataclass(frozen=True)
class RankIdentity:
    """Who this worker is; everything the handshake says besides the layout."""

    engine_id: str
    tp_rank: int
    tp_size: int
    total_kv_heads: int
    model: str
    produces: bool = True  # stages KV for others (kv_producer, kv_both)
    ssm_groups: int | None = None  # Mamba2's B/C groups in the model (None: unknown)


class WorkerSide:
    def __init__(
        self,
        cfg: ConnectorConfig,
        identity: RankIdentity,
        geometry: KVGeometry,
        groups: tuple[KVGroup, ...] = (),
    ) -> None:
        self.cfg = cfg
        self.groups = groups  # KV cache groups (empty: one, every layer in it)
        self.layer_groups: tuple[int, ...] = ()  # each layer's group
        self.identity = identity
        self.engine_id = identity.engine_id
        self.tp_rank, self.tp_size = identity.tp_rank, identity.tp_size
        self.geometry = geometry
        self.layout: KVLayout | None = None
        self.layers: list[Views] = []
        self._layer_tensors: list[torch.Tensor] = []  # physical, as vLLM registered them
        self.state: RecurrentState | None = None  # Mamba layers' state, if the model has any
        # vLLM hands a connector a Mamba layer's raw allocation; the layer itself holds
        # the state views (conv, SSM) its kernels use.
        self.layer_modules: dict[str, Any] = {}
        self.transport: KVTransport | None = None
        self.rank_meta: RankMetadata | None = None
        self.incarnation = new_incarnation()
        self._key = cfg.shared_key
        self.peers = PeerDirectory(self.engine_id, self._key, cfg.handshake_timeout_s)
        self._loader = Loader(self._load, self._failed, cfg.load_timeout_s)
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="qaic-kv-release")
        # Saves leave the engine's step: one thread, so a request's chunks land in order.
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="qaic-kv-save")
        self._saving: dict[str, Future[None]] = {}  # each request's latest save
        self._await_saves: set[str] = set()  # finished; vLLM holds their blocks for us
        self._headers: RegionHeaders | None = None
        self._direct = DirectReader()
        self._released_direct: set[str] = set()  # handed off directly; tickets invalidated
        self._load_errors: set[int] = set()
        # With several KV cache groups block ids are not unique, so vLLM takes failed
        # loads by request id (failed_recving) instead of by block.
        self._failed_requests: set[str] = set()
        self._stats = QAICConnectorStats()
        self._stats_lock = threading.Lock()
        self._metadata: QAICConnectorMetadata | None = None

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, cfg: ConnectorConfig, kv_cache_config: KVCacheConfig
    ) -> WorkerSide:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        groups = groups_of(kv_cache_config)
        spec = attention_spec(kv_cache_config)
        model_cfg = vllm_config.model_config
        hf = model_cfg.hf_text_config
        identity = RankIdentity(
            engine_id=str(ktc.engine_id),
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            total_kv_heads=model_cfg.get_total_num_kv_heads(),
            model=str(model_cfg.model).rstrip("/").rsplit("/", 1)[-1],
            produces=bool(ktc.is_kv_producer),
            ssm_groups=next(
                (v for k in SSM_GROUP_KEYS if isinstance(v := getattr(hf, k, None), int)), None
            ),
        )
        geometry = KVGeometry(
            num_heads=spec.num_kv_heads,  # type: ignore[attr-defined]
            head_size=spec.head_size,  # type: ignore[attr-defined]
            block_size=spec.block_size,
            dtype=spec.dtype,  # type: ignore[attr-defined]
        )
        worker = cls(cfg, identity, geometry, groups)
        worker.layer_modules = vllm_config.compilation_config.static_forward_context
        return worker

    # --- registration ----------------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], layout: KVLayout | None = None
    ) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        state_names = ordered_layers(self.groups, state=True)
        if state_names:
            layers = tuple(self._state_tensors(n, kv_caches) for n in state_names)
            groups = self.identity.ssm_groups
            splits = [
                mixer_splits(self.layer_modules.get(n), t, groups, self.tp_size)
                for n, t in zip(state_names, layers, strict=True)
            ]
            self.state = RecurrentState(
                layers,
                layer_groups(self.groups, state_names),
                () if None in splits else tuple(s for s in splits if s is not None),
                self.tp_size,
                self.tp_rank,
            )
        names = sorted(set(kv_caches) - set(state_names), key=extract_layer_index)
        tensors = [kv_caches[n] for n in names]
        self.layer_groups = layer_groups(self.groups, names)
        windows = tuple(self.groups[g].window for g in self.layer_groups) if self.groups else ()
        self.layout = layout or detect_layout(tensors[0], self.geometry)
        if self.layout.kind == "vllm_cpu" and self.cfg.verify_cpu_layout:
            from vllm_qaic_connector.layout_probe import verify_vllm_cpu_layout

            verify_vllm_cpu_layout(
                self.geometry.block_size, self.geometry.head_size, self.geometry.dtype
            )
        self.layers = [self.layout.kv_views(t, self.geometry) for t in tensors]
        self._layer_tensors = tensors
        name = staging_name(self.engine_id, self.tp_rank, self.incarnation)
        # A shm load maps the prefill's segment: an engine that only loads needs none.
        only_loads = self.cfg.transport == "shm" and not self.identity.produces
        staging = 0 if only_loads else self.cfg.staging_bytes
        self.transport = create_transport(
            self.cfg.transport, name, staging, self.cfg.load_timeout_s
        )
        one_group = self.state is None and len(self.groups) <= 1
        if self.cfg.transport == "nixl":  # peers' READs come from the cache or land in it
            direct = one_group and self.cfg.nixl_direct_reads
            cache = register_kv_cache(tensors, self.transport) if direct else None
        else:
            direct = one_group and self.cfg.direct_reads
            cache = share_kv_cache(tensors) if direct and self.identity.produces else None
        self._headers = RegionHeaders(self.transport.staging)
        model = self.identity.model
        dtype = str(self.geometry.dtype).removeprefix("torch.")
        total_heads = self.identity.total_kv_heads
        states = self.state.signature() if self.state else ()
        self.rank_meta = RankMetadata(
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            layout_kind=self.layout.kind,
            block_size=self.geometry.block_size,
            num_blocks=tensors[0].shape[0]
            if self.layout.kind == "vllm_cpu"
            else tensors[0].shape[1],
            num_kv_heads=total_heads,
            head_size=self.geometry.head_size,
            dtype=dtype,
            num_layers=len(tensors),
            model=model,
            compat_hash=compat_hash(
                model, dtype, len(tensors), total_heads, self.geometry.head_size, windows, states
            ),
            endpoint=self.transport.endpoint(),
            incarnation=self.incarnation,
            cache=cache if self.identity.produces else None,
            host=host_identity() if direct else "",
        )
        self.peers.ours = self.rank_meta
        logger.info(
            "QAICConnector worker rank %d: %s layout, %d layers, block %d, %s",
            self.tp_rank,
            self.layout.kind,
            len(tensors),
            self.geometry.block_size,
            self.cfg.transport,
        )

    def _state_tensors(self, name: str, kv_caches: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        module = self.layer_modules.get(name)
        state = module.kv_cache if module is not None else kv_caches[name]
        if not isinstance(state, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) and t.dim() >= 2 for t in state
        ):
            raise TypeError(f"QAICConnector: cannot read the state tensors of Mamba layer {name}")
        return tuple(state)

    def handshake_metadata(self) -> QAICHandshakeMetadata | None:
        return None if self.rank_meta is None else QAICHandshakeMetadata(self.rank_meta)

    # --- per step ----------------------------------------------------------------------------

    def bind(self, metadata: QAICConnectorMetadata | None) -> None:
        self._metadata = metadata
        if metadata is not None:
            self._await_saves.update(metadata.await_saves)

    def start_load_kv(self) -> None:
        if self._metadata is None:
            return
        for spec in self._metadata.loads:
            if spec.remote is None or spec.error is not None:
                self._loader.submit(spec)  # fails at once
                continue
            peer = (spec.remote.remote_host, spec.remote.remote_port)
            self.peers.poll(*peer)  # starts the handshake, or retries one that failed a while ago
            self._loader.submit(spec, peer, functools.partial(self._peer_resolved, *peer))

    def wait_for_save(self) -> None:
        """Stages this step's saves; with ``async_saves``, hands them to the save thread
        and returns. Then, before the ticket can leave, each sealing save promises its
        generation, so a decode that comes early waits for the seal instead of failing."""
        if self._metadata is None or self._headers is None:
            return
        for offset in self._metadata.invalidate:
            self._headers.invalidate(offset)
        self._released_direct.update(self._metadata.release_direct)
        for spec in self._metadata.saves:
            if spec.direct and spec.generation:
                self._seal_direct(spec)
        saves = [spec for spec in self._metadata.saves if not spec.direct]
        if not saves or not self.cfg.async_saves:
            self._save_all(saves)
            return
        for spec in saves:
            if spec.generation:
                self._headers.promise(spec.staging_offset, spec.generation)
        job = self._saver.submit(self._save_all, saves)
        for spec in saves:
            self._saving[spec.request_id] = job

    def _save_all(self, saves: list[SaveSpec]) -> None:
        assert self._headers is not None
        for spec in saves:
            try:
                self._save(spec)
            except Exception:
                logger.exception("QAICConnector: staging request %s failed", spec.request_id)
                self._headers.abandon(spec.staging_offset)  # its reader fails at once

    def _seal_direct(self, spec: SaveSpec) -> None:
        """Nothing to copy: the ticket's header says the held blocks are ready. On the
        engine thread, so no seal can land after the release that invalidates it."""
        assert self._headers is not None
        start, t0 = spec.staging_offset, time.monotonic()
        with self._headers.writing(start, start + HEADER_BYTES, spec.generation):
            pass
        with self._stats_lock:
            self._stats.add("saved_requests")
            self._stats.add("saved_tokens", spec.num_tokens)
            self._stats.sample("save_seconds", time.monotonic() - t0)

    def _saves_done(self) -> set[str]:
        """Finished requests whose saves are all done: vLLM may free their blocks."""
        done = {r for r in self._await_saves if (f := self._saving.get(r)) is None or f.done()}
        self._await_saves -= done
        for rid in done:
            self._saving.pop(rid, None)
        return done

    def _save(self, spec: SaveSpec) -> None:
        """Copy a finished prompt's KV into staging; the prefill's cache is only read."""
        assert self._headers is not None
        geometry = dataclasses.replace(self.geometry, block_size=spec.block_size)
        fmt = self._format(spec.layout_kind, geometry, len(self.layers), spec.starts)
        start = spec.staging_offset
        end = start + HEADER_BYTES + fmt.request_bytes(spec.num_tokens)
        staged_blocks = list(range(blocks_for_tokens(spec.num_tokens, fmt.geometry.block_size)))
        written, t0 = 0, time.monotonic()
        with self._headers.writing(start, end, spec.generation) as region:
            views = fmt.layer_views(region, spec.num_tokens)
            last = spec.last or spec.num_tokens
            for i, (src, dst) in enumerate(zip(self.layers, views, strict=True)):
                t = max(spec.starts[self._group(i)], spec.first)  # staged from fmt.shift(i)
                if t < last:
                    written += copy_tokens(
                        src, spec.block_ids[self._group(i)], dst, staged_blocks, t, last,
                        dst_t0=t - fmt.shift(i),
                    )  # fmt: skip
            if self.state is not None and spec.generation:  # the state after the last token
                staged_state = fmt.state_region(region, spec.num_tokens)
                written += self.state.save(spec.block_ids, staged_state)
        with self._stats_lock:
            if spec.generation:  # the prompt's last part
                self._stats.add("saved_requests")
                self._stats.add("saved_tokens", spec.num_tokens)
            self._stats.add("bytes_copied", written)
            self._stats.sample("save_seconds", time.monotonic() - t0)

    @property
    def _tp(self) -> tuple[int, int]:
        return self.tp_size, self.tp_rank

    def _group(self, layer: int) -> int:
        return self.layer_groups[layer] if self.layer_groups else 0

    def _format(
        self,
        kind: str,
        geometry: KVGeometry,
        num_layers: int,
        group_starts: tuple[int, ...],
        tp: tuple[int, int] | None = None,
    ) -> StagingFormat:
        """A staged request's format; ``group_starts``: its first staged token per group;
        ``tp``: (size, rank) of the rank that staged it, if not this one."""
        firsts = layer_starts(group_starts, self.layer_groups, num_layers)
        state = self.state.nbytes(*(tp or (None, None))) if self.state else 0
        return StagingFormat(kind, geometry, num_layers, firsts, state)

    # --- loads --------------------------------------------------------------------------------

    def _peer_ranks(self, remote: RemotePrefill) -> list[RankMetadata]:
        """The prefill's ranks as of the ticket's incarnation: a peer that restarted since
        we last met it is handshaken afresh, and its old mappings are dropped."""
        host, port = remote.remote_host, remote.remote_port
        ranks = self.peers.get(host, port, retry=False)  # the handshake this load waited on
        if ranks[0].incarnation != remote.incarnation:
            assert self.transport is not None
            for old in ranks:
                self.transport.forget_peer(old.endpoint)
                self._direct.forget(owner_of(old))
            self.peers.forget(host, port)
            ranks = self.peers.get(host, port)
        if ranks[0].engine_id != remote.remote_engine_id:
            raise ConnectionError(
                f"{host}:{port} is engine {ranks[0].engine_id!r}, not {remote.remote_engine_id!r}"
            )
        if ranks[0].incarnation != remote.incarnation:
            raise StaleTicket(f"engine {remote.remote_engine_id} restarted since it staged the KV")
        return ranks

    def _peer_resolved(self, host: str, port: int) -> bool:
        # retry=False: a busy loader that looks late must not start the handshake over.
        return self.peers.poll(host, port, retry=False) is not None

    def _failed(self, spec: LoadSpec, reason: str) -> LoadResult:
        # Only to a peer that answered a handshake: a dead one would hold a thread for
        # nothing (its lease frees the pages). Off this thread: it may be the engine's.
        remote = spec.remote
        if remote is not None and self.peers.answered(remote.remote_host, remote.remote_port):
            self._releaser.submit(self._release_remote, spec)
        source = spec.remote.remote_engine_id if spec.remote else ""
        return LoadResult(spec.request_id, self._blocks_to_load(spec), 0, 0, source)

    def _blocks_to_load(self, spec: LoadSpec, group: int | None = None) -> frozenset[int]:
        """The blocks a load writes, in one group or in all of them."""
        bs = self.geometry.block_size
        groups = range(len(spec.block_ids)) if group is None else [group]
        blocks: set[int] = set()
        for g in groups:
            ids = spec.block_ids[g]
            end = spec.end or len(ids) * bs
            first = spec.start(g) // bs
            blocks.update(ids[first : blocks_for_tokens(end, bs)])
        return frozenset(blocks)

    def _load(self, spec: LoadSpec, gate: WriteGate) -> LoadResult:
        """Reads each source rank's staged heads (ticket-checked) into our blocks."""
        if spec.error is not None or spec.remote is None:
            raise ValueError(spec.error or "no remote prefill")
        assert self.transport is not None
        remote = spec.remote
        ranks = self._peer_ranks(remote)
        if spec.holds_until and time.time() > spec.holds_until:
            late = time.time() - spec.holds_until
            raise StaleTicket(f"the staging lease ran out {late:.1f}s before the read")
        if remote.block_ids:
            return self._load_direct(spec, ranks, gate)
        total, src_tp = self.identity.total_kv_heads, len(ranks)
        src_blocks = list(range(blocks_for_tokens(remote.num_tokens, remote.staged_block_size)))
        copied, reads, t0 = 0, 0, time.monotonic()
        # Each source rank staged its own head shard (and state shard); read only what
        # this rank holds.
        kv_heads = {s.src_rank: s.heads for s in head_sources(total, src_tp, *self._tp)}
        for r in source_ranks(total, src_tp, *self._tp, state=self.state is not None):
            src_rank = ranks[r]
            src_geo = KVGeometry(
                len(heads_of_rank(total, src_tp, r)),
                src_rank.head_size,
                remote.staged_block_size,
                self.geometry.dtype,
            )
            staged = remote.group_starts or (0,) * len(spec.block_ids)
            fmt = self._format(
                remote.staged_layout, src_geo, src_rank.num_layers, staged, (src_tp, r)
            )
            # The acknowledgement rides on the last read of this source rank, when the
            # transport carries messages; otherwise it goes over the side channel below.
            notify = ack_message(remote.remote_request_id, self.tp_rank, self.tp_size, r, self._key)
            with (
                checked_read(
                    self.transport,
                    src_rank.endpoint,
                    remote.staging_offset,
                    fmt.request_bytes(remote.num_tokens),
                    remote.generation,
                    notify if self.transport.delivers_notifications else None,
                ) as region,
                gate.writing(),
            ):
                views = fmt.layer_views(region, remote.num_tokens)
                pairs = zip(views, self.layers, strict=True) if r in kv_heads else ()
                for i, (src, dst) in enumerate(pairs):  # none: a rank read for its state
                    t, shift = spec.start(self._group(i)), fmt.shift(i)
                    copied += copy_tokens(
                        src, src_blocks, dst, spec.block_ids[self._group(i)], t - shift,
                        spec.end - shift, kv_heads[r], dst_t0=t,
                    )  # fmt: skip
                if self.state is not None:
                    region_state = fmt.state_region(region, remote.num_tokens)
                    copied += self.state.load(region_state, spec.block_ids, src_tp, r)
                if self.cfg.debug_corrupt_loaded_kv:
                    for i, dst in enumerate(self.layers):
                        self._corrupt(dst, spec, self._group(i))
                    if self.state is not None:
                        self.state.zero(spec.block_ids)
            reads += 2  # the region with its header, then the header again
        if not self.transport.delivers_notifications:
            self._releaser.submit(self._release_remote, spec)  # a dead prefill: not our wait
        return LoadResult(
            spec.request_id, frozenset(), spec.end - spec.first_token, copied,
            ranks[0].engine_id, time.monotonic() - t0, reads,
        )  # fmt: skip

    def _load_direct(
        self, spec: LoadSpec, ranks: list[RankMetadata], gate: WriteGate
    ) -> LoadResult:
        """Copies the prompt's blocks out of the prefill rank's KV cache (mapped shm, or
        NIXL READs into our blocks), inside a check of the ticket's header-only region."""
        remote, transport = spec.remote, self.transport
        assert remote is not None and transport is not None
        assert self.layout is not None and self.rank_meta is not None
        src = ranks[self.tp_rank] if len(ranks) == self.tp_size else None
        problem = direct_problem(src, self.rank_meta, len(ranks)) if src else "TP sizes differ"
        if problem is None and remote.staged_block_size != self.geometry.block_size:
            problem = "the ticket's block size is not ours"
        t0, bs = time.monotonic(), self.geometry.block_size
        first, end, ours = spec.start(0), spec.end, spec.block_ids[0]
        if problem is None and first % bs and transport.kind == "nixl":
            problem = "the first token to load is inside a block"  # READs move whole blocks
        if problem is not None or src is None or src.cache is None:
            raise ConnectionError(f"cannot read the prefill's KV cache directly: {problem}")
        if max(remote.block_ids) >= src.num_blocks:
            raise ValueError(f"block_ids beyond the prefill's {src.num_blocks} blocks")
        lo, hi = first // bs, blocks_for_tokens(end, bs)
        notify = ack_message(
            remote.remote_request_id, self.tp_rank, self.tp_size, self.tp_rank, self._key
        )
        notifies = transport.delivers_notifications
        reads = 2  # the header, before and after
        with (
            checked_region(
                transport, src.endpoint, remote.staging_offset, remote.generation,
                notify if notifies else None,
            ),
            gate.writing(),
        ):  # fmt: skip
            if isinstance(transport, NixlTransport):
                pairs = list(zip(remote.block_ids[lo:hi], ours[lo:hi], strict=True))
                runs = plan_cache_reads(src.cache, self.layout, self._layer_tensors, pairs)
                copied, reads = (
                    transport.read_into(cache_endpoint(src.endpoint, src.cache), runs),
                    reads + len(runs),
                )
            else:
                mapped = self._direct.layers(owner_of(src), src.cache, self.layout, self.geometry)
                copied = (
                    sum(  # the first block is partly ours already
                        copy_tokens(s, remote.block_ids, d, ours, first, end)
                        for s, d in zip(mapped, self.layers, strict=True)
                    )
                    if first % bs
                    else self._direct.copy(
                        mapped, remote.block_ids[lo:hi], self.layers, ours[lo:hi]
                    )
                )
            if self.cfg.debug_corrupt_loaded_kv:
                for dst in self.layers:
                    self._corrupt(dst, spec, 0)
        if not notifies:
            self._releaser.submit(self._release_remote, spec)
        return LoadResult(
            spec.request_id, frozenset(), end - spec.first_token, copied,
            ranks[0].engine_id, time.monotonic() - t0, reads, direct=True,
        )  # fmt: skip

    def _corrupt(self, dst: Views, spec: LoadSpec, group: int) -> None:
        """Negative control: zero what was just loaded, so accuracy must collapse."""
        for block in self._blocks_to_load(spec, group):
            dst[0][block].zero_()
            dst[1][block].zero_()

    def _release_remote(self, spec: LoadSpec) -> None:
        if spec.remote is None:
            return
        try:
            side_channel.call(
                spec.remote.remote_host,
                spec.remote.remote_port,
                ReleaseRequest([spec.remote.remote_request_id], self.tp_rank, self.tp_size),
                self._key,
                self.cfg.handshake_timeout_s,
            )
        except ConnectionError as exc:
            logger.warning(
                "QAICConnector: could not release staging of %s (lease will expire): %s",
                spec.remote.remote_request_id,
                exc,
            )

    def take_acknowledgements(self) -> QAICWorkerMetadata | None:
        """Decode ranks' acknowledgements that arrived with their reads (prefill side)."""
        if self.transport is None:
            return None
        acks = [a for m in self.transport.poll_notifications() if (a := parse_ack(m, self._key))]
        return QAICWorkerMetadata(acks) if acks else None

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        done: set[str] = set()
        for result in self._loader.take_finished():
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
        self._direct.drop_dead()
        sending = self._saves_done() | self._released_direct
        self._released_direct = set()
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
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, QAICConnectorStats()
            return out

    def shutdown(self) -> None:
        self._saver.shutdown(wait=True)  # its writes go into the transport's staging
        self._loader.shutdown()
        self._releaser.shutdown(wait=False)  # queued releases still go out
        self._direct.close()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
