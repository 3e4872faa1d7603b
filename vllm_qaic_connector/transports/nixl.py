"""NIXL: a decode READs the prefill's registered staging region through NIXL agents over UCX.

Endpoint: ``address`` is ``"<agent name>@0x<staging base address>"`` (split at the last ``@``)
and ``agent_metadata`` is the agent's ``get_agent_metadata()``, so a reader needs no metadata
server or listener. A read is ONE transfer of the peer's contiguous ``[base+offset, +nbytes)``
into a slice of a local registered receive arena, in `PIECE`-sized descriptors: NIXL's cost
is per descriptor, and past 1 MiB a larger one is no faster.

Progress: over TCP, and for the notification a READ may carry, UCX needs the *target* to
progress its worker, or the reader's transfer stays in PROC. nixl's C++ progress thread does
that, but nixl's Python API pins its poll timeout to 0, a busy loop costing a core per agent.
We run that thread with a 100 ms timeout instead: it still wakes at once on the UCX worker's
event fd (notified reads ~0.1 ms on a quiet machine) and idles at ~0.05% of a core.

Copy threads: on one host UCX moves the bytes with ``process_vm_readv`` (``cma``) on the
thread that posts the READ, ~5 GB/s. Where the process may use two cores, UCX's thread-pool
engine (``num_threads``) splits a READ of `SPLIT_DESCRIPTORS` or more descriptors between
two threads with their own workers (~7 GB/s; `python -m testbed.handoff_bench`), and a
large staged read goes as `PIECE`-sized descriptors so that it splits too. The notification
still follows the last byte: UCX sends it once every part is done.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from vllm_qaic_connector.kv.byte_runs import ByteRun
from vllm_qaic_connector.kv.stream_copy import copy_threads
from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol.wire import SharedCache, TransportEndpoint
from vllm_qaic_connector.transports import host_pinning
from vllm_qaic_connector.transports.base import KVTransport, populate
from vllm_qaic_connector.transports.shared_cache import backing, described

logger = get_logger(__name__)

PROGRESS_TIMEOUT_US = 100_000  # idle wake-up of the progress thread; UCX events wake it sooner
ALIGN = 64  # receive slices start on a cache line, so the copy into KV blocks vectorises
MAX_PAUSE_S = 1e-3  # longest sleep between checks of a read in flight
PIECE = 1 << 20  # a staged read's descriptors: past 1 MiB one descriptor is no faster
SPLIT_DESCRIPTORS = 8  # fewer stay on the posting thread (UCX's default: 1,024)


def split_address(address: str) -> tuple[str, int]:
    """``"agent@0xbase"`` -> (agent name, staging base address)."""
    agent, _, base = address.rpartition("@")
    if not agent or not base.startswith("0x"):
        raise ValueError(f"not a nixl address (agent@0xbase): {address!r}")
    return agent, int(base, 16)


def _new_agent(nixl: Any, name: str) -> Any:
    """A nixl_agent with a UCX backend whose progress thread sleeps on events, not spins."""
    agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
    try:
        cfg = nixl._bindings.nixlAgentConfig()
        cfg.useProgThread, cfg.useListenThread = True, False
        cfg.pthrDelay = PROGRESS_TIMEOUT_US
        cfg.syncMode = nixl._bindings.NIXL_THREAD_SYNC_NONE  # we serialise our calls ourselves
        # The wrapper keeps its C++ agent in `.agent` and builds it with pthrDelay=0; swap it
        # while it has no backend yet (the discarded one never had any).
        agent.agent = nixl._bindings.nixlAgent(name, cfg)
    except (AttributeError, TypeError) as exc:  # another nixl build without these knobs
        logger.warning("nixl: cannot set the progress-thread delay (%s); it will spin", exc)
        return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=True))
    threads = copy_threads()
    params = {"num_threads": str(threads), "split_batch_size": str(SPLIT_DESCRIPTORS)}
    agent.create_backend("UCX", params if threads > 1 else {})
    return agent


def _zeroed(nbytes: int, faulted: bool = False) -> torch.Tensor:
    """Page-aligned anonymous memory: zero pages, committed only when written unless
    ``faulted`` (`populate`)."""
    mapping = mmap.mmap(-1, nbytes)
    if faulted:
        populate(mapping)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _memory(device: int) -> tuple[str, int]:
    """NIXL's memory type and device id for memory on CUDA ``device`` (-1: host)."""
    return ("DRAM", 0) if device < 0 else ("VRAM", device)


class _Held(NamedTuple):
    tensor: torch.Tensor
    start: int  # offset in the receive arena, or -1 for a one-off buffer
    reg: Any  # the one-off buffer's registration, or None


class NixlTransport(KVTransport):
    kind = "nixl"
    delivers_notifications = True
    direct_reads_key = "nixl_direct_reads"

    def __init__(
        self, name: str, staging_bytes: int, *, timeout_s: float = 30.0, stages: bool = True
    ) -> None:
        """``timeout_s`` bounds every read; ``stages``: saves will write the staging, so its
        pages are faulted in now (a decode's stay untouched). The receive arena, as large as
        the staging, is mapped on the first read; larger reads get a one-off buffer."""
        import nixl

        errors = vars(nixl._bindings).values()  # nixl raises its own Exception subclasses
        self._errors = tuple(c for c in errors if isinstance(c, type) and issubclass(c, Exception))
        self.agent_name, self.timeout_s = name, timeout_s
        self._lock = threading.RLock()  # the agent is NIXL_THREAD_SYNC_NONE
        self._agent: Any = _new_agent(nixl, name)
        # Where UCX was built with CUDA (cuda_ipc, cuda_copy, GPUDirect), it moves GPU memory.
        self.shares_device_memory = "VRAM_SEG" in self._agent.get_backend_mem_types("UCX")
        self._regs: list[Any] = []  # every live registration; close() deregisters them
        self._closed = False
        self._staging = _zeroed(staging_bytes, faulted=stages)
        self._register(self._staging)
        self._recv_bytes = staging_bytes
        self._recv: torch.Tensor | None = None
        self._used: list[tuple[int, int]] = []  # arena ranges handed out, sorted
        self._held: dict[tuple[str, int], list[_Held]] = {}
        self._peers: dict[str, bytes] = {}  # remote agents loaded, with their metadata
        # address -> (bytes, registration, CUDA device or -1)
        self._destinations: dict[int, tuple[int, Any, int]] = {}
        self._pinned: list[torch.Tensor] = []  # host memory page-locked for a GPU's copies
        self._pin = False

    @property
    def staging(self) -> torch.Tensor:
        return self._staging

    @property
    def registrations(self) -> int:
        return len(self._regs)

    @property
    def remote_agents(self) -> list[str]:
        return list(self._peers)

    def endpoint(self) -> TransportEndpoint:
        with self._lock:
            self._check_open()
            metadata = self._agent.get_agent_metadata()  # fresh: covers every registration
        address = f"{self.agent_name}@{self._staging.data_ptr():#x}"
        return TransportEndpoint(self.kind, address, self._staging.numel(), metadata)

    def read(
        self, peer: TransportEndpoint, offset: int, nbytes: int, *, notify: bytes | None = None
    ) -> torch.Tensor:
        """One NIXL READ (in `PIECE`s); ``notify`` reaches the peer's `poll_notifications`
        after the data."""
        agent, base = self._check_peer(peer)
        if offset < 0 or nbytes <= 0 or offset + nbytes > peer.size:
            raise ValueError(f"read [{offset}, {offset + nbytes}) outside segment {peer.address}")
        with self._lock:
            self._check_open()
            self._connect(agent, peer.agent_metadata)
            held = self._take(nbytes)
            dst = held.tensor.data_ptr()
            runs = [ByteRun(base + offset + i, dst + i, min(PIECE, nbytes - i))
                    for i in range(0, nbytes, PIECE)]  # fmt: skip
            handle, state = self._start(agent, runs, notify, held)
        self._wait(agent, handle, state, held)  # without the lock: other threads may poll
        with self._lock:
            self._held.setdefault((peer.address, offset), []).append(held)
        return held.tensor

    def share_kv_cache(self, layers: Sequence[torch.Tensor], produces: bool) -> SharedCache | None:
        """Registers the storage behind ``layers`` with the agent: peers READ from it (a
        prefill) or we READ into it (a decode)."""
        if (whole := backing(layers)) is None:
            return None
        self.register_destination(whole)
        return described(layers, whole.numel(), address=whole.data_ptr(), device=whole.get_device())

    def register_destination(self, tensor: torch.Tensor) -> None:
        """Let ``read_into`` write straight into ``tensor``'s memory (e.g. QAIC KV buffers)."""
        with self._lock:
            self._check_open()
            if tensor.data_ptr() not in self._destinations:
                reg = self._register(tensor)  # GPU memory registers as VRAM
                self._destinations[tensor.data_ptr()] = (tensor.nbytes, reg, tensor.get_device())

    def deregister_destination(self, tensor: torch.Tensor) -> None:
        with self._lock:  # none after close(), which deregistered them all
            if (held := self._destinations.pop(tensor.data_ptr(), None)) is not None:
                self._give_back(_Held(tensor, -1, held[1]))

    def read_into(
        self, peer: TransportEndpoint, runs: Sequence[ByteRun], *, base_offset: int = 0
    ) -> int:
        """One NIXL transfer, one descriptor per run: peer staging ``[base_offset + run.src,
        +nbytes)`` lands at local address ``run.dst``, which must lie in a registered
        destination. No receive buffer, no copy. Returns the bytes read."""
        agent, base = self._check_peer(peer)
        if not runs:
            return 0  # nixl cannot post a transfer of no descriptors
        with self._lock:
            self._check_open()
            starts, devices = sorted(self._destinations), set()
            for r in runs:
                src = base_offset + r.src
                if r.nbytes <= 0 or src < 0 or src + r.nbytes > peer.size:
                    raise ValueError(f"read [{src}, {src + r.nbytes}) outside {peer.address}")
                i = bisect.bisect_right(starts, r.dst) - 1  # the destination it starts in
                size, _, device = self._destinations[starts[i]] if i >= 0 else (0, None, -1)
                if i < 0 or r.dst + r.nbytes > starts[i] + size:
                    raise ValueError(f"destination {r.dst:#x}+{r.nbytes} is not registered")
                devices.add(device)
            if len(devices) > 1:  # one transfer's descriptors are of one memory
                raise ValueError(f"one read into several devices' memory: {sorted(devices)}")
            self._connect(agent, peer.agent_metadata)
            remote = [ByteRun(base + base_offset + r.src, r.dst, r.nbytes) for r in runs]
            handle, state = self._start(agent, remote, None, devices=(devices.pop(), peer.device))
        self._wait(agent, handle, state, None)
        return sum(r.nbytes for r in runs)

    def pin_host_memory(self) -> None:
        """Page-locks the staging and the receive arena (now, or when it is mapped)."""
        with self._lock:
            self._pin = True
            for region in (self._staging, self._recv):
                self._pin_region(region)

    def _pin_region(self, region: torch.Tensor | None) -> None:
        if region is None or not self._pin or any(region is t for t in self._pinned):
            return
        if host_pinning.pin(region, read_only=False):
            self._pinned.append(region)

    def release_read(self, peer: TransportEndpoint, offset: int) -> None:
        with self._lock:
            if stack := self._held.get((peer.address, offset)):
                self._give_back(stack.pop(0))
                if not stack:
                    del self._held[(peer.address, offset)]

    def poll_notifications(self) -> list[bytes]:
        """Messages peers attached to their READs of our staging, in arrival order."""
        with self._lock:
            notifs = {} if self._closed else self._agent.get_new_notifs()
        return [msg for msgs in notifs.values() for msg in msgs]

    def forget_peer(self, peer: TransportEndpoint) -> None:
        with self._lock:
            for key in [k for k in self._held if k[0] == peer.address]:
                for held in self._held.pop(key):
                    self._give_back(held)
            self._drop_peer(split_address(peer.address)[0])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for agent in list(self._peers):
                self._drop_peer(agent)
            self._held.clear()
            self._destinations.clear()
            for reg in self._regs:
                try:
                    self._agent.deregister_memory(reg)
                except self._errors as exc:
                    logger.warning("nixl: deregistration failed: %s", exc)
            self._regs.clear()
            self._agent = None  # unreferenced, the C++ agent stops its progress thread
            for region in self._pinned:  # before the mappings can go
                host_pinning.unpin(region)
            self._pinned.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"nixl transport {self.agent_name} is closed")

    def _start(
        self, agent: str, runs: Sequence[ByteRun], notify: bytes | None, held: _Held | None = None,
        devices: tuple[int, int] = (-1, -1),
    ) -> tuple[Any, str]:  # fmt: skip
        """Posts one READ (``run.src``: the peer's address; ``run.dst``: ours) under the lock;
        ``devices``: (ours, the peer's), a CUDA device or -1 for host memory. On failure
        gives ``held`` back and drops the peer."""
        (dst_mem, dst_dev), (src_mem, src_dev) = (_memory(d) for d in devices)
        try:
            local = self._agent.get_xfer_descs([(r.dst, r.nbytes, dst_dev) for r in runs], dst_mem)
            remote = self._agent.get_xfer_descs([(r.src, r.nbytes, src_dev) for r in runs], src_mem)
            handle = self._agent.initialize_xfer("READ", local, remote, agent, notify or b"")
            return handle, self._agent.transfer(handle)
        except self._errors as exc:
            if held is not None:
                self._give_back(held)
            self._drop_peer(agent)
            raise ConnectionError(f"NIXL read from {agent} failed: {exc}") from exc

    def _check_peer(self, peer: TransportEndpoint) -> tuple[str, int]:
        if peer.kind != self.kind:
            raise ConnectionError(f"peer uses transport {peer.kind!r}, we use {self.kind!r}")
        return split_address(peer.address)

    def _register(self, tensor: torch.Tensor) -> Any:
        reg = self._agent.register_memory(tensor)
        self._regs.append(reg)
        return reg

    def _connect(self, agent: str, metadata: bytes) -> None:
        if self._peers.get(agent) == metadata:
            return
        self._drop_peer(agent)  # a restarted peer: same name, new metadata
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except self._errors as exc:
            raise ConnectionError(f"cannot load NIXL metadata of {agent}: {exc}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._peers[loaded] = metadata
        if loaded != agent:
            self._drop_peer(loaded)
            raise ConnectionError(f"metadata names agent {loaded!r}, address says {agent!r}")

    def _drop_peer(self, agent: str) -> None:
        if self._peers.pop(agent, None) is not None:
            try:
                self._agent.remove_remote_agent(agent)
            except self._errors as exc:
                logger.warning("nixl: removing remote agent %s failed: %s", agent, exc)

    def _wait(self, agent: str, handle: Any, state: str, held: _Held | None) -> None:
        deadline, pause = time.monotonic() + self.timeout_s, 0.0
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(pause)  # 0 first: small reads finish in tens of microseconds
            pause = min(pause * 2 or 1e-5, MAX_PAUSE_S)
            with self._lock:
                if self._closed:  # close() from another thread: the buffer stays mapped
                    raise ConnectionError(f"transport closed during a read from {agent}")
                state = self._agent.check_xfer_state(handle)
        with self._lock:
            if state == "DONE":
                handle.release()
                return
            try:
                handle.release()  # cancels a transfer still in flight
                if held is not None:
                    self._give_back(held)
            except self._errors:  # keep the buffer out of circulation: UCX may still write it
                logger.warning("nixl: a read from %s could not be cancelled", agent)
            self._drop_peer(agent)  # reconnect afresh next time
        why = "failed" if state == "ERR" else f"timed out after {self.timeout_s:g}s"
        raise ConnectionError(f"NIXL read from {agent} {why}")

    def _take(self, nbytes: int) -> _Held:
        size = -(-nbytes // ALIGN) * ALIGN
        if self._recv is None and size <= self._recv_bytes:
            self._recv = _zeroed(self._recv_bytes)
            self._register(self._recv)
            self._pin_region(self._recv)
        start = 0
        for lo, hi in self._used:  # first fit
            if lo - start >= size:
                break
            start = hi
        if self._recv is not None and start + size <= self._recv_bytes:
            bisect.insort(self._used, (start, start + size))
            return _Held(self._recv[start : start + nbytes], start, None)
        buf = _zeroed(nbytes)  # arena full or too small: deregistered again on release
        return _Held(buf, -1, self._register(buf))

    def _give_back(self, held: _Held) -> None:
        if held.reg is None:
            self._used = [r for r in self._used if r[0] != held.start]
        elif any(r is held.reg for r in self._regs):
            self._regs = [r for r in self._regs if r is not held.reg]
            self._agent.deregister_memory(held.reg)
