"""Byte plans: where whole blocks, or a QAIC slot's tokens, lie as byte ranges, so a copy
or a NIXL READ moves them straight into a destination's memory (a cache, a slot). Pure:
numbers in, numbers out; nothing here touches memory."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_qaic_connector.layout import KVGeometry


@dataclass(frozen=True)
class ByteRun:
    src: int  # offset in the source region
    dst: int  # destination address (or offset)
    nbytes: int


@dataclass(frozen=True)
class BlockExtents:
    """Where one layer's blocks lie, in elements from the layer's first one: block ``b`` of
    plane ``p`` (K, V; one plane where a block holds both) spans ``elems`` elements from
    ``planes[p] + b * stride``."""

    planes: tuple[int, ...]
    stride: int
    elems: int

    @classmethod
    def of(cls, shape: Sequence[int], strides: Sequence[int], block_dim: int) -> BlockExtents:
        inner = shape[block_dim + 1 :]
        # Dense in some order (a vLLM view may list its dims out of memory order).
        by_stride = sorted(zip(strides[block_dim + 1 :], inner, strict=True))
        dense = [math.prod(n for _, n in by_stride[:i]) for i in range(len(inner))]
        if [s for s, _ in by_stride] != dense:
            raise ValueError(f"a block of a {tuple(shape)} layer with strides {strides} has gaps")
        planes = [p * strides[0] for p in range(shape[0])] if block_dim == 1 else [0]
        return cls(tuple(planes), strides[block_dim], math.prod(inner))


def block_ranges(
    src: BlockExtents, dst: BlockExtents, runs: Sequence[tuple[int, int, int]], itemsize: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source offsets, destination offsets, byte counts), from each layer's start, that
    copy the whole blocks of ``runs`` (`block_runs`) of every plane between two layers of
    one layout: a range per run where blocks lie back to back on both sides, else per
    block. No Python loop per block."""
    if len(src.planes) != len(dst.planes) or src.elems != dst.elems:
        raise ValueError(f"block extents differ: {src} vs {dst}")
    s0, d0, count = np.asarray(runs, dtype=np.int64).reshape(-1, 3).T
    if src.stride != src.elems or dst.stride != dst.elems:  # gaps between blocks
        s0, d0 = _each_block(s0, count), _each_block(d0, count)
        count = np.ones_like(s0)
    frm = [(p + s0 * src.stride) * itemsize for p in src.planes]
    to = [(p + d0 * dst.stride) * itemsize for p in dst.planes]
    sizes = np.tile(count * (src.elems * itemsize), len(src.planes))
    return np.concatenate(frm), np.concatenate(to), sizes


def _each_block(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Every block of the runs that start at ``first``, ``count`` blocks long."""
    within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return np.repeat(first, count) + within


def merged(
    frm: np.ndarray, to: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`merge_runs` over arrays: a range that continues the previous one on both sides
    joins it."""
    if not len(sizes):
        return frm, to, sizes
    goes_on = (frm[:-1] + sizes[:-1] == frm[1:]) & (to[:-1] + sizes[:-1] == to[1:])
    starts = np.flatnonzero(np.r_[True, ~goes_on])
    return frm[starts], to[starts], np.add.reduceat(sizes, starts)


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
    whole = num_tokens * row == head_bytes  # the prompt fills the slot: a plane is one run
    size, heads = (plane, [0]) if whole else (num_tokens * row, range(0, plane, head_bytes))
    return [
        ByteRun((2 * layer + kind) * plane + head, base + slot * plane + head, size)
        for layer, pair in enumerate(buffers)
        for kind, base in enumerate(pair)
        for head in heads  # each head's first byte in a plane
    ]
