"""The decode side of the handoff for a server that decodes on Cloud AI 100.

A server embeds one `DecodeEndpoint` and hands it each request's ``kv_transfer_params`` and
prompt. The endpoint answers prefills' handshakes as an engine with ``qaic_slot`` layout,
checks the ticket (`protocol.ticket.ticket_problem`, as a vLLM decode does), waits for a free
batch slot while renewing the lease (`protocol.leases`), writes the request's KV into the
slot (over shm a DMA-sliced copy out of the prefill's staging, over NIXL a READ straight
into slot k), acknowledges the read (on the READ, else with `side_channel.release`) and lets
the device decode from the slot. Every refusal names its cause (`Refused`).

The device sits behind `DecodeDevice`; the buffers of its compiled programs (the manifest)
are the endpoint's `SlotTarget`. docs/targets.md maps each method to the QAIC runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.layout import KVGeometry, blocks_for_tokens
from vllm_qaic_connector.protocol import side_channel, ticket, wire
from vllm_qaic_connector.protocol.leases import LeaseRenewer
from vllm_qaic_connector.protocol.peers import PeerDirectory
from vllm_qaic_connector.protocol.routed_params import routed_params
from vllm_qaic_connector.protocol.side_channel import SideChannelServer
from vllm_qaic_connector.qaic.slot_pull import SlotPuller
from vllm_qaic_connector.qaic.target import Manifest, SlotTarget, torch_dtype
from vllm_qaic_connector.region_headers import checked_read, new_incarnation
from vllm_qaic_connector.transports import create_transport, staging_name
from vllm_qaic_connector.transports.nixl import NixlTransport

T = TypeVar("T")
# bytes_copied: host copies only; dma_bytes: what lands in slots.
COUNTERS: tuple[str, ...] = ("loaded_requests", "loaded_tokens", "load_failures")
COUNTERS += ("bytes_copied", "dma_bytes", "slot_waits", "slot_wait_timeouts", "read_descriptors")


class DecodeDevice(Protocol):
    """What the endpoint needs of the QAIC decode programs whose buffers are ``target``."""

    def bind_slot(self, target: SlotTarget, slot: int, num_tokens: int) -> None:
        """Make tokens ``[0, num_tokens)`` of ``slot`` in every KV buffer the programs' KV."""

    def decode(
        self, target: SlotTarget, slot: int, prompt_ids: list[int], max_tokens: int
    ) -> tuple[list[int], str]:
        """Greedy decode steps from the slot's KV: the tokens and the finish reason. Up to
        ``EndpointConfig.exec_objects`` threads call it at once, each for its own slot."""

    def free_slot(self, target: SlotTarget, slot: int) -> None:
        """The slot's request is done; its KV may be overwritten."""


@dataclass(frozen=True)
class EndpointConfig:
    engine_id: str  # also names the slot segments: qaic_kv_<engine_id>_*
    model: str  # the model's name, as prefills name theirs
    weights: str = ""  # model_weights.checkpoint_fingerprint of the checkpoint compiled
    kv_cache_prefix: str | None = None  # QEfficient's, selecting the KV buffers
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    transport: str = "shm"  # how the prefill's staged KV reaches the slots: shm or nixl
    slot_wait_s: float = 60.0  # the longest a request waits for a free slot
    exec_objects: int = 1  # decodes run at once (each its own slot), as a QAIC exec-object pool


class Refused(Exception):
    """A request the endpoint does not decode; ``status``: the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DecodeEndpoint:
    def __init__(
        self, cfg: EndpointConfig, manifest: Manifest, device: DecodeDevice, key: bytes | None
    ) -> None:
        self.cfg, self.device, self.key = cfg, device, key
        self.target = t = SlotTarget(manifest, f"qaic_kv_{cfg.engine_id}", cfg.kv_cache_prefix)
        self.puller: SlotPuller | None = None
        incarnation = new_incarnation()
        try:  # nobody reads our staging; the transport is here for its reads of the prefill's
            name = staging_name(cfg.engine_id, 0, incarnation)
            self.reader = create_transport(cfg.transport, name, 4096, 10.0)
            if isinstance(self.reader, NixlTransport):
                self.puller = SlotPuller(t, self.reader)
            self.server = SideChannelServer(cfg.host, cfg.side_channel_port, self._handle, key)
        except BaseException:
            self._close_io()
            raise
        dtype = str(t.dtype).removeprefix("torch.")
        self.rank = wire.RankMetadata(
            engine_id=cfg.engine_id, tp_rank=0, tp_size=1, layout_kind="qaic_slot",
            block_size=t.ctx_len,  # one slot = one block: the prefill stages exactly a slot
            num_blocks=t.num_slots, num_kv_heads=t.num_heads, head_size=t.head_dim, dtype=dtype,
            num_layers=t.num_layers, model=cfg.model, weights=cfg.weights,
            compat_hash=wire.compat_hash(t.num_layers, t.num_heads, t.head_dim),
            endpoint=self.reader.endpoint(),  # over NIXL: the agent holding the slot buffers
            incarnation=incarnation,
        )  # fmt: skip
        self.peers = PeerDirectory(cfg.engine_id, key, timeout_s=10.0)
        self.peers.ours = self.rank  # refuse prefills whose KV we cannot use
        self.leases = LeaseRenewer(key, 10.0)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.slots_in_use = self.slots_in_use_max = 0
        self._slot_sem = asyncio.Semaphore(t.num_slots)
        self._ids = itertools.count()
        # Binds (read, slot write, release) run on their own thread, one at a time (a shm
        # transport has one user), decodes on the exec objects': the event loop never blocks.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="qaic-bind")
        self._compute = ThreadPoolExecutor(cfg.exec_objects, thread_name_prefix="qaic-decode")

    def _handle(self, msg: wire.Message) -> wire.Message:
        if isinstance(msg, wire.HandshakeRequest):
            return wire.handshake_reply(msg, [self.rank])
        if isinstance(msg, wire.ReleaseRequest):
            return wire.Ok()  # we never stage anything for others
        return wire.ErrorReply(f"unexpected message {type(msg).__name__}")

    async def decode(
        self, params: Any, prompt_ids: list[int], max_tokens: int
    ) -> tuple[list[int], str]:
        """Decode a handed-off request from its prompt's KV: the tokens and the finish
        reason. The prompt is the staged one, or it and the prefill's first token."""
        try:
            routed = routed_params(params)
            if routed.error:  # a decode program cannot compute the prompt itself
                raise Refused(503, f"the prefill could not hand the KV off: {routed.error}")
            if not routed.do_remote_prefill:
                want = "kv_transfer_params with do_remote_prefill (send it through a router)"
                raise Refused(400, f"a QAIC decode only decodes handed-off requests: {want}")
            remote = ticket.parse_remote_prefill(params)
        except ValueError as exc:
            raise Refused(400, str(exc)) from None
        if unusable := ticket.ticket_problem(remote, self.key):  # unsigned: never contacted
            raise Refused(403, unusable)
        rid, acked, slot = f"qaic-{next(self._ids)}", False, None
        self.leases.want(rid, remote)  # renewed while it waits for a slot
        try:
            # The programs run the base model ("": no LoRA adapter).
            if unusable := ticket.ticket_problem(remote, None, prompt=prompt_ids, adapter=""):
                raise Refused(400, unusable)
            if not len(prompt_ids) - 1 <= remote.num_tokens <= self.target.ctx_len:
                raise Refused(400, f"{remote.num_tokens} staged tokens for a prompt of "
                              f"{len(prompt_ids)} and slots of {self.target.ctx_len}")  # fmt: skip
            slot = await self._acquire_slot()
            try:
                held = self.leases.holds_until(rid)
                acked = await self._run(self._io, self._bind, slot, remote, held)
            except (ConnectionError, ValueError) as exc:
                self.counters["load_failures"] += 1
                raise Refused(502, f"KV load failed: {exc}") from None
            self.counters["loaded_requests"] += 1
            self.counters["loaded_tokens"] += remote.num_tokens
            run = self.device.decode
            return await self._run(self._compute, run, self.target, slot, prompt_ids, max_tokens)
        finally:
            self.leases.drop(rid)
            if not acked:  # read over shm, failed, or refused: free the prefill's staging now
                await self._run(self._io, side_channel.release, remote, self.key, 10.0)
            if slot is not None:
                self._free_slot(slot)

    async def refuse(self, params: Any, refusal: Refused) -> NoReturn:
        """Raises ``refusal``, a server's own (a body it cannot serve), after freeing the
        prefill's staging of a sound ticket, as the endpoint's own refusals do."""
        with contextlib.suppress(ValueError):
            remote = ticket.parse_remote_prefill(params)
            if ticket.ticket_problem(remote, self.key) is None:
                await self._run(self._io, side_channel.release, remote, self.key, 10.0)
        raise refusal

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _acquire_slot(self) -> int:
        if self._slot_sem.locked():
            self.counters["slot_waits"] += 1
        try:
            await asyncio.wait_for(self._slot_sem.acquire(), self.cfg.slot_wait_s)
        except asyncio.TimeoutError:
            self.counters["slot_wait_timeouts"] += 1
            slots, wait = self.target.num_slots, self.cfg.slot_wait_s
            raise Refused(503, f"all {slots} decode slots busy for {wait}s") from None
        slot = self.target.allocate_slot()  # cannot fail: the semaphore counts free slots
        self.slots_in_use += 1
        self.slots_in_use_max = max(self.slots_in_use_max, self.slots_in_use)
        return slot

    def _free_slot(self, slot: int) -> None:
        self.device.free_slot(self.target, slot)
        self.target.release_slot(slot)
        self.slots_in_use -= 1
        self._slot_sem.release()

    def _bind(self, slot: int, remote: ticket.RemotePrefill, held_until: float) -> bool:
        """Write the staged prompt KV into ``slot`` and bind it; whether the read carried
        the acknowledgement (NIXL), so no release is left to send."""
        if late := ticket.ticket_problem(remote, None, renewed_until=held_until):
            raise ConnectionError(late)
        ranks = self.peers.staged_by(remote)
        src, n = ranks[0], remote.num_tokens
        if len(ranks) != 1:
            raise ConnectionError(f"peer is {src.engine_id!r} with TP {len(ranks)}, want TP 1")
        geo = KVGeometry(src.num_kv_heads, src.head_size, remote.staged_block_size,
                         torch_dtype(src.dtype))  # fmt: skip
        notifies = self.reader.delivers_notifications  # else: released over the side channel
        ack = wire.ack_message(remote.remote_request_id, 0, 1, 0, self.key) if notifies else None
        binding = ticket.ticket_binding(remote)
        # Staged as exactly one of our slots: the READ lands in it (else: convert on host).
        if remote.staged_layout == "qaic_slot" and self.puller and geo == self.target.geometry:
            runs = self.puller.pull(slot, src.endpoint, remote.staging_offset, geo, n,
                                    remote.generation, ack, binding)  # fmt: skip
            self.counters["read_descriptors"] += len(runs)
            self.counters["dma_bytes"] += sum(r.nbytes for r in runs)  # the READ is the DMA
        else:
            fmt = StagingFormat(remote.staged_layout, geo, src.num_layers)
            blocks = list(range(blocks_for_tokens(n, remote.staged_block_size)))
            with checked_read(self.reader, src.endpoint, remote.staging_offset,
                              fmt.request_bytes(n), remote.generation, ack,
                              binding) as region:  # fmt: skip
                written = self.target.write_slot_from_blocks(
                    slot, fmt.layer_views(region, n), blocks, n
                )
            # Staged as our slot: the device DMAs [slot, :, 0:n, :] straight from the
            # staging bytes (setDataWithSlices), no host copy. Otherwise the host converts
            # (layout, block size or dtype) in its one copy into the slot.
            if remote.staged_layout != "qaic_slot" or geo != self.target.geometry:
                self.counters["bytes_copied"] += written
            self.counters["dma_bytes"] += written
        self.device.bind_slot(self.target, slot, n)
        return ack is not None

    def metrics(self) -> list[tuple[str, str, int]]:
        """Prometheus rows (name, type, value), named as vLLM names its KV-connector stats."""
        rows = [(f"vllm:qaic_kv_{k}_total", "counter", v) for k, v in self.counters.items()]
        return rows + [
            ("vllm:qaic_slots_total", "gauge", self.target.num_slots),
            ("vllm:qaic_slots_in_use", "gauge", self.slots_in_use),
            ("vllm:qaic_slots_in_use_max", "gauge", self.slots_in_use_max),
        ]

    def close(self) -> None:
        self.server.close()
        self.leases.close()
        self._io.shutdown(wait=True, cancel_futures=True)
        self._compute.shutdown(wait=True, cancel_futures=True)
        self._close_io()

    def _close_io(self) -> None:
        """Deregister the slot buffers before the agent goes, unlink the slots last."""
        if self.puller is not None:
            self.puller.close()
        if hasattr(self, "reader"):
            self.reader.close()
        self.target.close()
