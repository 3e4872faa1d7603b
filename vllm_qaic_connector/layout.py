"""The layout model: one `KVLayout` per physical KV format, and their canonical views.

Every layout yields, per layer and without copying, K and V views shaped
``[blocks, heads, block_tokens, head_dim]``. All conversions (NHD<->HND, CPU packing,
re-blocking, head sharding for TP) are then one operation on those views, copy tokens
``[t0, t1)`` of heads ``[h0, h1)`` (`kv.token_copies`); a staged request's bytes are
`kv.staging_format`. Nothing here imports vLLM or does I/O.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm_qaic_connector.cpu_packing import CPU_PACKINGS, PackedKV, Tiling
from vllm_qaic_connector.protocol.names import LAYOUT_ALIASES, LAYOUT_KINDS


@dataclass(frozen=True)
class KVGeometry:
    """Shape facts shared by every layer of one engine rank."""

    num_heads: int  # KV heads held by this rank
    head_size: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_heads * self.block_size * self.head_size * self.dtype.itemsize


class KVLayout(ABC):
    """One physical per-layer KV storage format. A new backend is one new subclass."""

    kind: ClassVar[str]
    block_dim: ClassVar[int] = 1  # the physical dim that indexes blocks (dims before: K/V)

    @abstractmethod
    def physical_shape(self, num_blocks: int, geo: KVGeometry) -> tuple[int, ...]:
        """Shape of one layer's tensor holding ``num_blocks`` blocks."""

    @abstractmethod
    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided canonical K and V views ``[blocks, heads, block_tokens, head_dim]``."""

    def layer_view(self, physical: torch.Tensor) -> torch.Tensor:
        """A layer as `kv_views` (and vLLM) read it, from its tensor in memory order
        (`physical_shape`); no copy."""
        return physical

    def allocate(self, num_blocks: int, geo: KVGeometry) -> torch.Tensor:
        return self.layer_view(torch.zeros(self.physical_shape(num_blocks, geo), dtype=geo.dtype))

    def from_bytes(self, buf: torch.Tensor, num_blocks: int, geo: KVGeometry) -> torch.Tensor:
        """Interpret a flat uint8 tensor as one layer of ``num_blocks`` blocks (no copy)."""
        return self.layer_view(buf.view(geo.dtype).view(self.physical_shape(num_blocks, geo)))


class VllmPagedLayout(KVLayout):
    """vLLM's own layouts (0.32, `KVCacheLayout`, RFC #42082): a layer is the logical view
    ``[blocks, H, block_tokens, C]`` that `create_kv_cache_views` builds, C a token's K then
    V (``2 * head_dim``), whatever the physical order; the order only decides the strides.

    A cross-layer order (block outermost, every layer's page of a block side by side) has
    the per-layer order of its layer-compact twin: a staged region of it is laid out so.
    """

    layer_order: ClassVar[tuple[int, ...]]  # memory order of a layer's [B, H, N, C]
    block_dim = 0

    def physical_shape(self, num_blocks: int, geo: KVGeometry) -> tuple[int, ...]:
        logical = (num_blocks, geo.num_heads, geo.block_size, 2 * geo.head_size)
        return tuple(logical[i] for i in self.layer_order)

    def layer_view(self, physical: torch.Tensor) -> torch.Tensor:
        return physical.permute(tuple(self.layer_order.index(i) for i in range(4)))

    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        return layer[..., : geo.head_size], layer[..., geo.head_size :]


# vLLM's `KVCacheLayout` members, each as the memory order of one layer's [B, H, N, C]
# (its ``layer_view_order``; tests check them against the installed vLLM).
VLLM_ORDERS = {
    "LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3), "LHBNC": (1, 0, 2, 3),
    "BLHNC": (0, 1, 2, 3), "BLNHC": (0, 2, 1, 3), "BHLNC": (0, 1, 2, 3),
}  # fmt: skip


class VllmCpuLayout(KVLayout):
    """vLLM CPU backend, ``[num_blocks, H, B, 2D]`` read as ``[num_blocks, H, 2B, D]``: rows
    ``0..B-1`` of each (block, head) hold K, rows ``B..2B-1`` V, each packed the way the
    attention ISA vLLM picked on that host needs (`cpu_packing`). `layout_probe` checks
    the packing against the installed vLLM's own cache-write op before trusting it."""

    tilings: ClassVar[tuple[Tiling, Tiling]]
    block_dim = 0  # K and V share a block: [H, 2B, D]

    def physical_shape(self, num_blocks: int, geo: KVGeometry) -> tuple[int, ...]:
        return (num_blocks, geo.num_heads, geo.block_size, 2 * geo.head_size)

    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        nb, heads, bs, d = layer.shape[0], geo.num_heads, geo.block_size, geo.head_size
        packed = layer.view(nb, heads, 2 * bs, d)
        raw = packed[:, :, :bs], packed[:, :, bs:]
        try:  # a strided view where the packing allows one (vec: K is stored transposed)
            k, v = (t.unpack(r, copy=False) for t, r in zip(self.tilings, raw, strict=True))
        except RuntimeError:
            return PackedKV(*raw, self.tilings)
        return k, v


class QaicSlotLayout(KVLayout):
    """QAIC retained state: one ``[slots, H, ctx, D]`` tensor per K and per V.

    A slot is one block of ``ctx`` tokens. In memory a layer is K buffer then V buffer,
    ``[2, slots, H, ctx, D]``: the pair of named buffers side by side.
    """

    kind = "qaic_slot"

    def physical_shape(self, num_blocks: int, geo: KVGeometry) -> tuple[int, ...]:
        return (2, num_blocks, geo.num_heads, geo.block_size, geo.head_size)

    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        return layer[0], layer[1]


class MlaLatentLayout(VllmPagedLayout):
    """Multi-head latent attention (DeepSeek-V2/V3): vLLM's MLA cache ``[blocks,
    block_tokens, latent]``, one latent per token (compressed KV, then the RoPE key), the
    same on every TP rank. Read as one head whose K and V are the latent's two halves, so
    every copy (re-blocking included) moves a token's latent whole."""

    kind = "mla_latent"
    layer_order = (0, 1, 2, 3)

    def kv_views(self, layer: torch.Tensor, geo: KVGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        return super().kv_views(
            layer.view(-1, geo.num_heads, geo.block_size, 2 * geo.head_size), geo
        )


LAYOUTS: dict[str, KVLayout] = {
    n: type(f"Vllm{n}Layout", (VllmPagedLayout,), {"kind": n, "layer_order": o})()
    for n, o in VLLM_ORDERS.items()
}
LAYOUTS |= {
    n: type(f"Cpu{n}Layout", (VllmCpuLayout,), {"kind": n, "tilings": t})()
    for n, t in CPU_PACKINGS.items()
}
LAYOUTS[QaicSlotLayout.kind] = QaicSlotLayout()
LAYOUTS[MlaLatentLayout.kind] = MlaLatentLayout()
if tuple(LAYOUTS) != LAYOUT_KINDS:
    raise ImportError("names.LAYOUT_KINDS must name every layout, in order")


def get_layout(kind: str) -> KVLayout:
    """The layout named ``kind``: one of vLLM's names, or an alias (the NHD/HND of vLLM
    before 0.32 read as vLLM does: LBNHC/LBHNC)."""
    try:
        return LAYOUTS[LAYOUT_ALIASES.get(kind, kind)]
    except KeyError:
        raise ValueError(f"unknown KV layout {kind!r}; known: {sorted(LAYOUTS)}") from None


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)


KV = tuple[torch.Tensor, torch.Tensor]  # a layer's canonical K and V views
