"""Physical KV layouts, their canonical views, and the one token-copy primitive.

Every layout yields, per layer and without copying, K and V views shaped
``[blocks, heads, block_tokens, head_dim]``. All conversions (NHD<->HND, CPU packing,
re-blocking, head sharding for TP) are one operation on those views: copy tokens
``[t0, t1)`` of heads ``[h0, h1)``. Nothing here imports vLLM or does I/O.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class KVGeometry:
    """Shape facts shared by every layer of one engine rank."""

    num_heads: int  # KV heads held by this rank
    head_size: int
    block_size: int
    dtype: torch.dtype

    @property
    def elements_per_block(self) -> int:
        return 2 * self.num_heads * self.block_size * self.head_size

    @property
    def bytes_per_block(self) -> int:
        return self.elements_per_block * self.dtype.itemsize


class KVLayout(ABC):
    """One physical per-layer KV storage format. A new backend is one new subclass."""

    kind: ClassVar[str]

    @abstractmethod
    def physical_shape(self, num_blocks: int, geo: KVGeometry) -> tuple[int, ...]:
        """Shape of one layer's tensor holding ``num_blocks`` blocks."""

    @abstractmethod
    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided canonical K and V views ``[blocks, heads, block_tokens, head_dim]``."""

    def allocate(self, num_blocks: int, geo: KVGeometry) -> torch.Tensor:
        return torch.zeros(self.physical_shape(num_blocks, geo), dtype=geo.dtype)

    def from_bytes(self, buf: torch.Tensor, num_blocks: int, geo: KVGeometry) -> torch.Tensor:
        """Interpret a flat uint8 tensor as one layer of ``num_blocks`` blocks (no copy)."""
        return buf.view(geo.dtype).view(self.physical_shape(num_blocks, geo))


class CudaNHDLayout(KVLayout):
    """vLLM CUDA backends, ``[2, num_blocks, B, H, D]``."""

    kind = "cuda_nhd"

    def physical_shape(self, num_blocks: int, geo: KVGeometry) -> tuple[int, ...]:
        return (2, num_blocks, geo.block_size, geo.num_heads, geo.head_size)

    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        return layer[0].permute(0, 2, 1, 3), layer[1].permute(0, 2, 1, 3)


class CudaHNDLayout(KVLayout):
    """vLLM CUDA backends with ``VLLM_KV_CACHE_LAYOUT=HND``, ``[2, num_blocks, H, B, D]``."""

    kind = "cuda_hnd"

    def physical_shape(self, num_blocks: int, geo: KVGeometry) -> tuple[int, ...]:
        return (2, num_blocks, geo.num_heads, geo.block_size, geo.head_size)

    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        return layer[0], layer[1]


class VllmCpuLayout(KVLayout):
    """vLLM CPU backend, ``[num_blocks, H, B, 2D]`` read as ``[num_blocks, H, 2B, D]``.

    Rows ``0..B-1`` of each (block, head) hold K stored transposed (``[D, B]`` in memory),
    rows ``B..2B-1`` hold V as ``[B, D]``. `worker_side` verifies this against the installed
    vLLM's own cache-write op before trusting it.
    """

    kind = "vllm_cpu"

    def physical_shape(self, num_blocks: int, geo: KVGeometry) -> tuple[int, ...]:
        return (num_blocks, geo.num_heads, geo.block_size, 2 * geo.head_size)

    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        nb, heads, bs, d = layer.shape[0], geo.num_heads, geo.block_size, geo.head_size
        packed = layer.view(nb, heads, 2 * bs, d)
        head_stride, block_stride = packed.stride(1), packed.stride(0)
        key = torch.as_strided(
            packed,
            size=(nb, heads, bs, d),
            stride=(block_stride, head_stride, 1, bs),
            storage_offset=packed.storage_offset(),
        )
        return key, packed[:, :, bs:, :]


class QaicSlotLayout(KVLayout):
    """QAIC retained state: one ``[slots, H, ctx, D]`` tensor per K and per V.

    A slot is one block of ``ctx`` tokens. In memory a layer is K buffer then V buffer,
    ``[2, slots, H, ctx, D]``, which is exactly the pair of named buffers side by side.
    """

    kind = "qaic_slot"

    def physical_shape(self, num_blocks: int, geo: KVGeometry) -> tuple[int, ...]:
        return (2, num_blocks, geo.num_heads, geo.block_size, geo.head_size)

    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        return layer[0], layer[1]


LAYOUTS: dict[str, KVLayout] = {
    cls.kind: cls() for cls in (CudaNHDLayout, CudaHNDLayout, VllmCpuLayout, QaicSlotLayout)
}


def get_layout(kind: str) -> KVLayout:
    try:
        return LAYOUTS[kind]
    except KeyError:
        raise ValueError(f"unknown KV layout {kind!r}; known: {sorted(LAYOUTS)}") from None


# ---------------------------------------------------------------------------
# Token copy plans


@dataclass(frozen=True)
class TokenRun:
    """A run of tokens that stays inside one source block and one destination block."""

    src_block: int  # index into the source block list
    src_offset: int
    dst_block: int  # index into the destination block list
    dst_offset: int
    length: int


def plan_token_runs(
    t0: int, t1: int, src_block_size: int, dst_block_size: int, dst_t0: int | None = None
) -> list[TokenRun]:
    """Split tokens ``[t0, t1)`` (source positions) into runs that cross no block edge.

    ``dst_t0`` is where ``t0`` lands on the destination side (default: same position).
    """
    if t0 < 0 or t1 < t0:
        raise ValueError(f"bad token range [{t0}, {t1})")
    shift = (t0 if dst_t0 is None else dst_t0) - t0
    runs: list[TokenRun] = []
    t = t0
    while t < t1:
        d = t + shift
        src_left = src_block_size - t % src_block_size
        dst_left = dst_block_size - d % dst_block_size
        n = min(src_left, dst_left, t1 - t)
        runs.append(
            TokenRun(
                t // src_block_size, t % src_block_size, d // dst_block_size, d % dst_block_size, n
            )
        )
        t += n
    return runs


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


@dataclass(frozen=True)
class HeadRange:
    """Heads ``[start, stop)`` of the source, written from head ``dst_start`` on."""

    start: int
    stop: int
    dst_start: int = 0


def copy_tokens(
    src: tuple[torch.Tensor, torch.Tensor],
    src_blocks: Sequence[int],
    dst: tuple[torch.Tensor, torch.Tensor],
    dst_blocks: Sequence[int],
    t0: int,
    t1: int,
    heads: HeadRange | None = None,
    dst_t0: int | None = None,
) -> int:
    """Copy tokens ``[t0, t1)`` of ``heads`` from canonical views ``src`` to ``dst``.

    ``src_blocks[i]`` / ``dst_blocks[i]`` is the physical block holding logical block i.
    Returns the number of bytes written.
    """
    src_bs, dst_bs = src[0].shape[2], dst[0].shape[2]
    if src[0].shape[3] != dst[0].shape[3]:
        raise ValueError(f"head size differs: {src[0].shape[3]} vs {dst[0].shape[3]}")
    h = heads or HeadRange(0, src[0].shape[1])
    nh = h.stop - h.start
    if h.dst_start + nh > dst[0].shape[1] or h.stop > src[0].shape[1]:
        raise ValueError(f"head range {h} does not fit {src[0].shape[1]}->{dst[0].shape[1]}")
    runs = plan_token_runs(t0, t1, src_bs, dst_bs, dst_t0)
    written = 0
    whole = src_bs == dst_bs and all(r.length == src_bs for r in runs)
    for s, d in zip(src, dst, strict=True):
        if whole:
            # Block-aligned: one batched gather/scatter instead of a loop over runs.
            si = torch.tensor([src_blocks[r.src_block] for r in runs], dtype=torch.long)
            di = torch.tensor([dst_blocks[r.dst_block] for r in runs], dtype=torch.long)
            d[di, h.dst_start : h.dst_start + nh] = s[si, h.start : h.stop]
            written += len(runs) * nh * src_bs * s.shape[3] * s.element_size()
            continue
        for r in runs:
            d[
                dst_blocks[r.dst_block],
                h.dst_start : h.dst_start + nh,
                r.dst_offset : r.dst_offset + r.length,
            ].copy_(
                s[src_blocks[r.src_block], h.start : h.stop, r.src_offset : r.src_offset + r.length]
            )
            written += nh * r.length * s.shape[3] * s.element_size()
    return written


def gather_tokens(
    kv: tuple[torch.Tensor, torch.Tensor], blocks: Sequence[int], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: K and V of the first ``num_tokens`` tokens, ``[heads, tokens, head_dim]``."""
    out = []
    for view in kv:
        bs = view.shape[2]
        parts = [view[blocks[t // bs], :, t % bs, :] for t in range(num_tokens)]
        out.append(torch.stack(parts, dim=1) if parts else view[:0, :, 0, :].transpose(0, 1))
    return out[0], out[1]


# ---------------------------------------------------------------------------
# Byte plans: reads straight into a destination's memory (NIXL into QAIC slots)


@dataclass(frozen=True)
class ByteRun:
    src: int  # offset in the source region
    dst: int  # destination address (or offset)
    nbytes: int


def merge_runs(runs: Iterable[ByteRun]) -> list[ByteRun]:
    """Fewer, longer runs: a run that continues the previous one on both sides joins it
    (a transfer costs per descriptor)."""
    out: list[ByteRun] = []
    for r in runs:
        last = out[-1] if out else None
        if last and last.src + last.nbytes == r.src and last.dst + last.nbytes == r.dst:
            out[-1] = ByteRun(last.src, last.dst, last.nbytes + r.nbytes)
        elif r.nbytes:
            out.append(r)
    return out


def plan_slot_reads(
    geo: KVGeometry, num_tokens: int, slot: int, buffers: Sequence[tuple[int, int]]
) -> list[ByteRun]:
    """Runs that move a request staged as one ``qaic_slot`` block (``geo.block_size`` is the
    slot's ctx) into ``[slot, h, 0:num_tokens, :]`` of each layer's K and V buffer, given as
    base addresses of ``[slots, H, ctx, D]`` tensors. A head's tokens are one run on both
    sides; all heads of a buffer merge into one when the prompt fills the slot."""
    if not 0 < num_tokens <= geo.block_size or slot < 0:
        raise ValueError(f"{num_tokens} tokens into slot {slot} of ctx {geo.block_size}")
    row = geo.head_size * geo.dtype.itemsize
    head_bytes = geo.block_size * row
    plane = geo.num_heads * head_bytes  # one layer's K (or V) of one slot, staged or target
    return merge_runs(
        ByteRun(
            (2 * layer + kind) * plane + h * head_bytes,
            base + slot * plane + h * head_bytes,
            num_tokens * row,
        )  # fmt: skip
        for layer, pair in enumerate(buffers)
        for kind, base in enumerate(pair)
        for h in range(geo.num_heads)
    )


# ---------------------------------------------------------------------------
# Staging: one request's KV laid out as [layers][physical blocks] in a flat region


@dataclass(frozen=True)
class StagingFormat:
    """How a staged request is laid out: the layout and geometry of its blocks."""

    layout_kind: str
    geometry: KVGeometry
    num_layers: int

    def request_bytes(self, num_tokens: int) -> int:
        nb = blocks_for_tokens(num_tokens, self.geometry.block_size)
        return self.num_layers * nb * self.geometry.bytes_per_block

    def layer_views(
        self, region: torch.Tensor, num_tokens: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Canonical views of each layer inside a staged region (flat uint8, no copy)."""
        layout = get_layout(self.layout_kind)
        nb = blocks_for_tokens(num_tokens, self.geometry.block_size)
        per_layer = nb * self.geometry.bytes_per_block
        return [
            layout.kv_views(
                layout.from_bytes(region[i * per_layer : (i + 1) * per_layer], nb, self.geometry),
                self.geometry,
            )
            for i in range(self.num_layers)
        ]
