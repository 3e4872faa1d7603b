"""How vLLM's CPU backend packs a KV block, per attention ISA: pure tile math.

vLLM 0.32 CPU stores each (block, head) of K and of V the way the attention kernel it picked
on that host reads it (csrc/cpu/cpu_attn_*.hpp, ``reshape_and_cache``). Each packing is a
`Tiling` per plane; `layout.VllmCpuLayout` makes one layout of each. `layout_probe` proves
which one a host writes with vLLM's own op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tiling:
    """How vLLM's CPU backend packs one (block, head)'s K or V ``[B, D]``: tokens in tiles
    of ``tokens`` (0: the whole block), dims in tiles of ``dims`` (0: the whole head), and
    ``order`` the memory order of (token tile, token in tile, dim tile, dim in tile)."""

    tokens: int
    dims: int
    order: tuple[int, int, int, int] = (0, 1, 2, 3)

    def split(self, bs: int, d: int) -> tuple[int, int, int, int]:
        tb, td = self.tokens or bs, self.dims or d
        if bs % tb or d % td:
            raise ValueError(f"block {bs} x head {d} does not tile by {tb} x {td}")
        return bs // tb, tb, d // td, td

    def unpack(self, raw: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """Canonical ``[n, H, B, D]`` from blocks' elements in memory order (``raw``, shaped
        alike): a copy, or with ``copy`` false a view (RuntimeError where none exists)."""
        n, h, bs, d = raw.shape
        split = self.split(bs, d)
        back = tuple(2 + self.order.index(i) for i in range(4))
        tiles = raw.reshape(n, h, *(split[i] for i in self.order)).permute(0, 1, *back)
        return tiles.reshape(n, h, bs, d) if copy else tiles.view(n, h, bs, d)

    def pack(self, canonical: torch.Tensor) -> torch.Tensor:
        """The inverse of `unpack`: blocks' elements in memory order, shaped ``[n, H, B, D]``."""
        n, h, bs, d = canonical.shape
        tiles = canonical.reshape(n, h, *self.split(bs, d))
        return tiles.permute(0, 1, *(2 + i for i in self.order)).reshape(n, h, bs, d)


class PackedKV(tuple[torch.Tensor, torch.Tensor]):
    """K and V of a layout whose tokens no strided view can index (vLLM CPU's ``amx``):
    each (block, head)'s elements in memory order, shaped ``[blocks, H, B, D]``, with the
    tilings that say where token t's dim d lies. Whole blocks copy as they are;
    `copy_layers` unpacks and packs anything else."""

    tilings: tuple[Tiling, Tiling]

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, tilings: tuple[Tiling, Tiling]) -> PackedKV:
        kv = super().__new__(cls, (k, v))
        kv.tilings = tilings
        return kv


# vLLM 0.32 CPU's packings (csrc/cpu/cpu_attn_*.hpp `reshape_and_cache`), by the name
# peers say. ``vec``: K transposed per block and head, V as is (also vec16, neon without
# bf16 dot products, vsx, vxe, rvv). ``amx`` (bf16 only): K in tiles of 16 tokens by 2
# dims (a 4-byte word), V in tiles of 2 tokens by 16 dims. ``neon_bf16`` (BFMMLA): K in
# tiles of 8 tokens by 4 dims, V of 4 tokens by 2 dims.
CPU_PACKINGS: dict[str, tuple[Tiling, Tiling]] = {
    "vllm_cpu_vec": (Tiling(0, 1, (0, 2, 1, 3)), Tiling(0, 0)),
    "vllm_cpu_amx": (Tiling(16, 2, (0, 2, 1, 3)), Tiling(2, 16, (2, 0, 3, 1))),
    "vllm_cpu_neon_bf16": (Tiling(8, 4, (0, 2, 1, 3)), Tiling(4, 2, (2, 0, 3, 1))),
}  # fmt: skip
