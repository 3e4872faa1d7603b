"""A QAIC decode target in host shared memory: named program buffers and batch slots.

Every buffer of every program is one POSIX shm segment, so the QAIC runtime can DMA from
exactly these bytes. A request owns batch slot k; writing its KV writes
``[k, :, 0:n, :]`` of each selected KV buffer (what qaicrt ``setDataWithSlices`` does with
DimSpecs ``[batch_index, 0, ctx_start, 0]``) and nothing else, so refilling one slot never
re-sends the others. Non-KV buffers are allocated but never read or written here.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import torch

from vllm_qaic_connector.kv.copy_pool import CopyPool
from vllm_qaic_connector.layout import KV, KVGeometry
from vllm_qaic_connector.protocol.wire import CONVERTIBLE_DTYPES
from vllm_qaic_connector.qaic.buffers import kv_buffer_regex, parse_kv_name
from vllm_qaic_connector.transports.shm import SharedSegment


def torch_dtype(name: str) -> torch.dtype:
    """``"float16"`` / ``"torch.float16"`` -> ``torch.float16``; ValueError if unknown."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


_CONVERTIBLE = {torch_dtype(name) for name in CONVERTIBLE_DTYPES}


class BufferSpec(msgspec.Struct, frozen=True):
    """One named program buffer. KV buffers are ``[slots, heads, ctx, head_dim]``; the
    layer and K/V a buffer holds come from its name (see qaic.buffers)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("buffer name must not be empty")
        # msgspec checks types only when decoding; a list from Python would compare unequal.
        msgspec.structs.force_setattr(self, "shape", tuple(self.shape))
        if not all(type(d) is int and d >= 0 for d in self.shape):
            raise ValueError(f"buffer {self.name!r}: bad shape {self.shape}")
        torch_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.dtype).itemsize


class BufferRef(NamedTuple):
    program: int
    spec: BufferSpec


class Manifest(msgspec.Struct):
    """The buffers of a decode deployment: one list per program. A model split over two
    programs is two lists, e.g. one holding layers [0, k), the other [k, L)."""

    programs: list[list[BufferSpec]]

    def __post_init__(self) -> None:
        for p, buffers in enumerate(self.programs):
            if dup := [n for n, c in Counter(b.name for b in buffers).items() if c > 1]:
                raise ValueError(f"program {p} lists buffer(s) {sorted(dup)} more than once")

    def kv_buffers(self, prefix: str | None) -> list[tuple[BufferRef, BufferRef]]:
        """Per layer ``0..L-1``, the (K, V) buffers. Strict: each manifest buffer is its own
        host allocation, so a layer's K or V held twice (even as input name and
        RetainedState name) would be two copies that can disagree; that, a missing layer,
        or KV buffers of differing shape/dtype raise ValueError."""
        pattern = kv_buffer_regex(prefix)
        found: dict[tuple[int, str], BufferRef] = {}
        for p, buffers in enumerate(self.programs):
            for spec in buffers:
                if (parsed := parse_kv_name(spec.name, pattern)) is None:
                    continue  # vision/multimodal and other buffers are never touched
                key = (parsed.layer, parsed.kind)
                if old := found.get(key):
                    raise ValueError(
                        f"layer {parsed.layer} {parsed.kind} is held twice: program "
                        f"{old.program} {old.spec.name!r} and program {p} {spec.name!r}"
                    )
                found[key] = BufferRef(p, spec)
        if not found:
            raise ValueError(f"no KV buffers match kv_cache_prefix {prefix!r}")
        num_layers = max(layer for layer, _ in found) + 1
        expected = {(i, k) for i in range(num_layers) for k in ("key", "value")}
        if missing := sorted(expected - found.keys()):
            names = ", ".join(f"{i} {k}" for i, k in missing[:8])
            raise ValueError(f"KV buffers missing for layer(s): {names}")
        first = found[(0, "key")].spec
        if len(first.shape) != 4 or 0 in first.shape:
            raise ValueError(f"KV buffer {first.name!r} is {first.shape}, not [slots, H, ctx, D]")
        for ref in found.values():
            if (ref.spec.shape, ref.spec.dtype) != (first.shape, first.dtype):
                raise ValueError(
                    f"KV buffer {ref.spec.name!r} is {ref.spec.shape} {ref.spec.dtype}, but "
                    f"{first.name!r} is {first.shape} {first.dtype}"
                )
        return [(found[(layer, "key")], found[(layer, "value")]) for layer in range(num_layers)]


class SlotTarget:
    """All buffers of a manifest in host shm (segments ``{name_prefix}_p{program}_b{index}``:
    buffer names may hold characters a file name cannot), plus a thread-safe slot allocator.
    Writes to distinct slots may run concurrently."""

    def __init__(self, manifest: Manifest, name_prefix: str, kv_cache_prefix: str | None) -> None:
        kv_refs = manifest.kv_buffers(kv_cache_prefix)  # validate before allocating anything
        self._copies = CopyPool()
        self._segments: list[SharedSegment] = []
        self._buffers: list[dict[str, torch.Tensor]] = []  # per program: name -> shm view
        self._closed = False
        try:
            for p, specs in enumerate(manifest.programs):
                self._buffers.append({})
                for i, spec in enumerate(specs):
                    # mmap refuses length 0, so an empty buffer gets a 1-byte segment.
                    seg = SharedSegment(f"{name_prefix}_p{p}_b{i}", max(spec.nbytes, 1), True)
                    self._segments.append(seg)
                    typed = seg.tensor[: spec.nbytes].view(torch_dtype(spec.dtype))
                    self._buffers[p][spec.name] = typed.view(spec.shape)
        except BaseException:
            self.close()
            raise
        self._kv: list[KV] = [
            (self._buffers[k.program][k.spec.name], self._buffers[v.program][v.spec.name])
            for k, v in kv_refs
        ]
        spec = kv_refs[0][0].spec
        self.num_slots, self.num_heads, self.ctx_len, self.head_dim = spec.shape
        self.dtype, self.num_layers = torch_dtype(spec.dtype), len(kv_refs)
        self._free = list(range(self.num_slots))  # a heap: lowest free slot first
        self._lock = threading.Lock()

    @property
    def geometry(self) -> KVGeometry:
        """A slot as one KV block: the format a prefill stages a request in for it."""
        return KVGeometry(self.num_heads, self.head_dim, self.ctx_len, self.dtype)

    @property
    def segment_names(self) -> list[str]:
        return [seg.name for seg in self._segments]

    def buffer(self, program: int, name: str) -> torch.Tensor:
        """Any buffer of a program, by name (for the runtime/emulator; never written here)."""
        self._check_open()
        return self._buffers[program][name]

    def kv(self, layer: int) -> KV:
        """Layer ``layer``'s K and V buffers, each ``[slots, heads, ctx, head_dim]`` (shm views)."""
        self._check_open()
        return self._kv[layer]

    def allocate_slot(self) -> int:
        """Take the lowest free slot; RuntimeError when every slot is in use."""
        self._check_open()
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {self.num_slots} decode slots are in use")
            return heapq.heappop(self._free)

    def release_slot(self, slot: int) -> None:
        """Free a slot. Its bytes stay as they are: the next owner overwrites [0, n) and the
        program's attention mask hides positions past its own length."""
        self._check_slot(slot)
        with self._lock:
            if slot in self._free:
                raise ValueError(f"slot {slot} is not allocated (double release?)")
            heapq.heappush(self._free, slot)

    def write_slot_from_blocks(
        self, slot: int, layer_views: Sequence[KV], blocks: Sequence[int], num_tokens: int
    ) -> int:
        """Write tokens ``[0, num_tokens)`` of every layer into ``slot`` from canonical views
        ``[blocks, heads, block_tokens, head_dim]`` (e.g. ``StagingFormat.layer_views``) and
        the request's block ids: the slot is one block of ``ctx`` tokens, so this is
        `CopyPool.layers` into block ``slot``, converting another float dtype (a bf16
        prefill's KV, a float16 program) as it writes. Returns the bytes written."""
        self.check_writable(slot, num_tokens)
        if len(layer_views) != self.num_layers:
            raise ValueError(f"got KV for {len(layer_views)} layers, target has {self.num_layers}")
        for layer, (k, _) in enumerate(layer_views):
            converts = {k.dtype, self.dtype} <= _CONVERTIBLE
            if not (k.dtype == self.dtype or converts) or k.shape[1] != self.num_heads:
                raise ValueError(
                    f"layer {layer} source is {k.dtype} with {k.shape[1]} heads, "
                    f"target is {self.dtype} with {self.num_heads}"
                )
            if len(blocks) * k.shape[2] < num_tokens:
                raise ValueError(f"{len(blocks)} blocks of {k.shape[2]} < {num_tokens} tokens")
        return self._copies.layers(layer_views, blocks, self._kv, [slot], 0, num_tokens)

    def close(self) -> None:
        """Unlink every segment (idempotent). Views handed out by ``kv``/``buffer`` stay
        valid: they hold the mapping, which goes with the last of them."""
        self._closed = True
        self._copies.close()
        self._buffers, self._kv = [], []
        for seg in self._segments:
            seg.close()
        self._segments = []

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SlotTarget is closed")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")

    def check_writable(self, slot: int, num_tokens: int) -> None:
        """ValueError unless ``slot`` is allocated and ``num_tokens`` fits it."""
        self._check_open()
        self._check_slot(slot)
        if not 0 <= num_tokens <= self.ctx_len:
            raise ValueError(f"num_tokens {num_tokens} outside [0, ctx_len={self.ctx_len}]")
        with self._lock:
            if slot in self._free:
                raise ValueError(f"slot {slot} is not allocated; call allocate_slot() first")
