"""The one token-copy primitive and its plans: copy tokens ``[t0, t1)`` of heads
``[h0, h1)`` between the canonical views of any two layouts, every layer at once (`copy_layers`),
whole blocks between equal CPU packings, and the byte plans the
native copy runs (`BlockRows`, `BlockTiles`). Nothing here imports vLLM or does I/O.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_qaic_connector.cpu_packing import PackedKV
from vllm_qaic_connector.kv.stream_copy import NATIVE, BlockRows, BlockTiles
from vllm_qaic_connector.layout import KV


def plan_token_runs(
    t0: int, t1: int, src_block_size: int, dst_block_size: int, dst_t0: int | None = None
) -> np.ndarray:
    """Split tokens ``[t0, t1)`` (source positions) into runs that cross no block edge, one
    row each: source block, destination block (indices into the block lists), source
    offset, destination offset, length. Vectorized: no Python step per token or block.

    ``dst_t0`` is where ``t0`` lands on the destination side (default: same position).
    """
    if t0 < 0 or t1 < t0:
        raise ValueError(f"bad token range [{t0}, {t1})")
    shift = (t0 if dst_t0 is None else dst_t0) - t0
    edges = [  # every block edge of either side inside the range, in source positions
        np.arange(a - a % bs + bs, max(a - a % bs + bs, a + t1 - t0), bs) - a + t0
        for a, bs in ((t0, src_block_size), (t0 + shift, dst_block_size))
    ]
    bounds = np.unique(np.concatenate([[t0, t1], *edges]).astype(np.int64))  # sorted
    start, dst = bounds[:-1], bounds[:-1] + shift
    return np.stack([
        start // src_block_size, dst // dst_block_size,
        start % src_block_size, dst % dst_block_size, np.diff(bounds),
    ], axis=1)  # fmt: skip


@dataclass(frozen=True)
class HeadRange:
    """Heads ``[start, stop)`` of the source, written from head ``dst_start`` on."""

    start: int
    stop: int
    dst_start: int = 0


def copy_layers(
    src: Sequence[KV], src_blocks: Sequence[int], dst: Sequence[KV], dst_blocks: Sequence[int],
    t0: int, t1: int, heads: HeadRange | None = None, dst_t0: int | None = None,
) -> int:  # fmt: skip
    """Tokens ``[t0, t1)`` (of ``heads``) for every layer pair of ``src`` and ``dst``: where
    the native row copy applies and the layers share strides (one allocation, as vLLM makes
    them), one call covers every layer, so the Python cost is per plan step, not per layer."""
    if not src or not dst:
        return 0
    h = heads or HeadRange(0, src[0][0].shape[1])
    if isinstance(src[0], PackedKV) or isinstance(dst[0], PackedKV):
        return _copy_packed(src, src_blocks, dst, dst_blocks, t0, t1, h, dst_t0)
    k, k_out = src[0][0], dst[0][0]
    src_bs, dst_bs = k.shape[2], k_out.shape[2]
    if k.shape[3] != k_out.shape[3]:
        raise ValueError(f"head size differs: {k[0, 0].shape} vs {k_out[0, 0].shape}")
    nh = h.stop - h.start
    if h.dst_start + nh > k_out.shape[1] or h.stop > k.shape[1]:
        raise ValueError(f"head range {h} does not fit {k.shape[1]}->{k_out.shape[1]}")
    ints = _INTS[k_out.element_size()]
    batches = _batches(t0, t1, src_bs, dst_bs, dst_t0, src_blocks, dst_blocks,
                       k.shape[0], k_out.shape[0])  # fmt: skip
    for plane in (0, 1):
        s_ = [s[plane][:, h.start : h.stop] for s in src]
        d_ = [d[plane][:, h.dst_start : h.dst_start + nh] for d in dst]
        # Planned once per call: one shape and strides on each side, so one plan per run
        # length and every layer's blocks as addresses from the layers' bases.
        # Bytes are copied there: another dtype is converted by torch, in the same one pass.
        bytewise = NATIVE and k.dtype == k_out.dtype and _one_cpu_shape(s_, d_)
        bases = (_bases(s_), _bases(d_)) if bytewise else None
        for b in batches:
            plan = _native_plan(s_[0], d_[0], b.n) if bases else None
            if plan and bases:
                plan.copy(_addresses(s_[0], bases[0], b.src_ids, b.src_at),
                          _addresses(d_[0], bases[1], b.dst_ids, b.dst_at))  # fmt: skip
                continue
            for so, do, src_ids, dst_ids in b.parts:
                src_ids, dst_ids = _on(src_ids, k.device), _on(dst_ids, k_out.device)
                for s_one, d_one in _layer_pairs(s_, d_):
                    _copy_one_layer(s_one[:, :, so : so + b.n], src_ids,
                                    d_one[:, :, do : do + b.n], dst_ids, ints)  # fmt: skip
    return tokens_bytes(dst, t0, t1, h)


def _copy_packed(
    src: Sequence[KV], src_blocks: Sequence[int], dst: Sequence[KV], dst_blocks: Sequence[int],
    t0: int, t1: int, h: HeadRange, dst_t0: int | None,
) -> int:  # fmt: skip
    """`copy_layers` where a side is packed: whole blocks as they are between equal packings
    from a block's start, else through canonical copies of the blocks involved (a packed
    destination's blocks are unpacked, written and packed back, so tokens outside
    ``[t0, t1)`` keep their bytes)."""
    src_bs, dst_bs = src[0][0].shape[2], dst[0][0].shape[2]
    at = t0 if dst_t0 is None else dst_t0
    src_ids = _block_ids(src_blocks, t0, t1, src_bs)
    dst_ids = _block_ids(dst_blocks, at, at + t1 - t0, dst_bs)
    hs, hd = slice(h.start, h.stop), slice(h.dst_start, h.dst_start + h.stop - h.start)
    s_packed, d_packed = isinstance(src[0], PackedKV), isinstance(dst[0], PackedKV)
    same = s_packed and d_packed and src[0].tilings == dst[0].tilings  # type: ignore[attr-defined]
    if same and src_bs == dst_bs and t0 % src_bs == 0 == at % dst_bs:
        for s_kv, d_kv in zip(src, dst, strict=True):  # the tail past t1 is no data yet
            for s_, d_ in zip(s_kv, d_kv, strict=True):
                d_[dst_ids, hd] = s_[src_ids, hs]
        return tokens_bytes(dst, t0, t1, h)
    # A packed side is copied in canonical form: its blocks are then 0, 1, ... there.
    s_blocks = range(len(src_ids)) if s_packed else src_ids.tolist()
    d_blocks = range(len(dst_ids)) if d_packed else dst_ids.tolist()
    for s_kv, d_kv in zip(src, dst, strict=True):
        d_c = _canonical(d_kv, dst_ids) if d_packed else d_kv
        s_c = _canonical(s_kv, src_ids) if s_packed else s_kv
        copy_layers([s_c], s_blocks, [d_c], d_blocks,
                    t0 % src_bs, t0 % src_bs + t1 - t0, h, at % dst_bs)  # fmt: skip
        if isinstance(d_kv, PackedKV):
            for plane, tiling, canonical in zip(d_kv, d_kv.tilings, d_c, strict=True):
                plane[dst_ids] = tiling.pack(canonical)
    return tokens_bytes(dst, t0, t1, h)


def _block_ids(blocks: Sequence[int], t0: int, t1: int, block_size: int) -> torch.Tensor:
    """The physical blocks holding tokens ``[t0, t1)``."""
    return torch.as_tensor(list(blocks[t0 // block_size : -(-t1 // block_size)]), dtype=torch.long)


def _canonical(kv: KV, ids: torch.Tensor) -> KV:
    """Blocks ``ids`` of ``kv`` as canonical copies, unpacked where packed."""
    if isinstance(kv, PackedKV):
        return kv.tilings[0].unpack(kv[0][ids]), kv.tilings[1].unpack(kv[1][ids])
    return kv[0][ids], kv[1][ids]


def tokens_bytes(layers: Sequence[KV], t0: int, t1: int, heads: HeadRange | None = None) -> int:
    """The bytes of K and V of tokens ``[t0, t1)`` of ``heads`` (all: None) in ``layers``."""
    if not layers:
        return 0
    k = layers[0][0]
    nh = heads.stop - heads.start if heads else k.shape[1]
    return 2 * nh * (t1 - t0) * k.shape[3] * k.element_size() * len(layers)


def layer_runs(num_layers: int, *keys: Callable[[int], int]) -> list[tuple[tuple[int, ...], slice]]:
    """Consecutive layers that agree on every key (KV cache group, staging shift): each run
    is one `copy_layers` call."""
    runs = itertools.groupby(range(num_layers), lambda i: tuple(k(i) for k in keys))
    return [(key, slice(first, first + 1 + len(rest))) for key, (first, *rest) in runs]


def _native_plan(src: torch.Tensor, dst: torch.Tensor, n: int) -> BlockRows | BlockTiles | None:
    """How the native copy moves ``n`` tokens of each block of these views, where it can
    and is faster than numpy."""
    shape = (*src.shape[1:2], n, *src.shape[3:])
    dims = zip(shape, src.stride()[1:], dst.stride()[1:], strict=True)
    return _block_plan(tuple(d for d in dims if d[0] > 1), src.element_size())


@functools.lru_cache(maxsize=256)  # a few shapes per layout pair, asked per copy
def _block_plan(dims: tuple[tuple[int, int, int], ...], item: int) -> BlockRows | BlockTiles | None:
    return block_rows(list(dims), item) or block_tiles(list(dims), item)


def _copy_one_layer(s_: torch.Tensor, src_ids: _Index, d_: torch.Tensor, dst_ids: _Index,
                    ints: torch.dtype) -> None:  # fmt: skip
    if s_.dtype != d_.dtype:  # converted as it is written (a float16 QAIC program's slot)
        d_[dst_ids] = s_[src_ids].to(d_.device)
    elif s_.device.type != "cpu" or d_.device.type != "cpu":  # a GPU's: its gathers, as ints
        d_.view(ints)[dst_ids] = s_.view(ints)[src_ids].to(d_.device)
    elif isinstance(dst_ids, slice) and isinstance(src_ids, torch.Tensor):  # to staging
        torch.index_select(s_, 0, src_ids, out=d_[dst_ids])  # slice by slice, in place
    else:
        # torch's scatters (index_put_, index_copy_) go element by element, and its
        # strided copies trail numpy's on K transposed (vllm_cpu). Numpy on
        # same-size ints: any dtype, any strides, whole slices at a time.
        into = dst_ids if isinstance(dst_ids, slice) else dst_ids.numpy()
        d_.view(ints).numpy()[into] = s_[src_ids].view(ints).numpy()


def _layer_pairs(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The views to copy one pair at a time. In GPU memory, where each side's layers lie
    evenly spaced in one allocation (vLLM's caches, staging), all layers as one view with
    a last dim for the layer: one kernel a copy, not one a layer."""
    if len(src) > 1 and "cpu" not in (src[0].device.type, dst[0].device.type):
        s_all, d_all = _stacked(src), _stacked(dst)
        if s_all is not None and d_all is not None:
            return [(s_all, d_all)]
    return list(zip(src, dst, strict=True))


def _stacked(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Views of one shape and strides, each ``step`` bytes after the last in one storage,
    as one view ``[*shape, len(views)]``; None otherwise."""
    first, item = views[0], views[0].element_size()
    step = views[1].data_ptr() - first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    for i, v in enumerate(views):
        if (v.shape, v.stride(), v.data_ptr()) != (first.shape, first.stride(), first.data_ptr()
            + i * step) or v.untyped_storage().data_ptr() != storage:  # fmt: skip
            return None
    if step <= 0 or step % item:
        return None
    return first.as_strided((*first.shape, len(views)), (*first.stride(), step // item))


def _on(ids: _Index, device: torch.device) -> _Index:
    return ids if isinstance(ids, slice) or device.type == "cpu" else ids.to(device)


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Since one native call covers a whole batch of blocks, rows of 16 bytes and up copy 1.3-6x
# faster natively than through numpy (re-blocking vLLM CPU's K: a row is a block's tokens).
MIN_ROW_BYTES = 16


Dims = list[tuple[int, int, int]]  # a block's (size, source stride, destination stride)


def block_tiles(dims: Dims, item: int) -> BlockTiles | None:
    """How to copy a block of ``dims`` (elements of ``item`` bytes) where one dim is
    contiguous in the source and another in the destination (K of vllm_cpu, stored
    transposed, against any other layout). None for anything else."""
    along_src = [i for i, d in enumerate(dims) if d[1] == 1]
    along_dst = [i for i, d in enumerate(dims) if d[2] == 1]
    if len(dims) > 3 or not along_src or not along_dst or along_src == along_dst:
        return None
    r, c = dims[along_src[0]], dims[along_dst[0]]
    o = next((d for i, d in enumerate(dims) if i not in (along_src[0], along_dst[0])), (1, 0, 0))
    strides = (o[2], r[2], c[2], o[1], r[1], c[1])  # destination's, then source's
    return BlockTiles(o[0], r[0], c[0], item, *(x * item for x in strides))


def block_rows(dims: Dims, item: int) -> BlockRows | None:
    """How to copy a block of ``dims`` (elements of ``item`` bytes): dims contiguous on
    both sides merge into the row, the rest (two at most) stay loops. None where rows
    would be shorter than `MIN_ROW_BYTES`."""
    # the dim of adjacent elements on both sides (vLLM CPU's K: tokens) starts the row
    dims = [d for d in dims if d[1:] != (1, 1)] + [d for d in dims if d[1:] == (1, 1)]
    chunk = 1
    while dims and dims[-1][1:] == (chunk, chunk):  # contiguous on both sides so far
        chunk *= dims.pop()[0]
    dims = [(1, 0, 0)] * (2 - len(dims)) + dims
    if chunk * item < MIN_ROW_BYTES or len(dims) > 2:
        return None
    (na, sa, da), (nb, sb, db) = dims
    return BlockRows(na, nb, chunk * item, da * item, db * item, sa * item, sb * item)


def _one_cpu_shape(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> bool:
    """Every view on the CPU with its side's first view's shape and strides."""
    return all(
        t.device.type == "cpu" and (t.shape, t.stride()) == (side[0].shape, side[0].stride())
        for side in (src, dst)
        for t in side
    )


def _bases(views: Sequence[torch.Tensor]) -> np.ndarray:
    return np.array([v.data_ptr() for v in views], dtype=np.int64)


def _addresses(
    view: torch.Tensor, bases: np.ndarray, ids: np.ndarray, at: np.ndarray
) -> np.ndarray:
    """Byte addresses of token ``at[i]`` of block ``ids[i]`` of every view starting at
    ``bases`` (of ``view``'s shape and strides), view by view (`_batches` checked the ids)."""
    offsets = (ids * view.stride(0) + at * view.stride(2)) * view.element_size()
    return np.add.outer(bases, offsets).ravel().astype(np.uint64)


_Index = torch.Tensor | slice  # physical blocks; a slice where evenly spaced, as staged


@dataclass(frozen=True)
class _Batch:
    """Runs of one length ``n``: run i copies from token ``src_at[i]`` of block
    ``src_ids[i]`` to token ``dst_at[i]`` of ``dst_ids[i]``."""

    n: int
    src_ids: np.ndarray
    src_at: np.ndarray
    dst_ids: np.ndarray
    dst_at: np.ndarray

    @functools.cached_property
    def parts(self) -> list[tuple[int, int, _Index, _Index]]:
        """The runs grouped by offsets (source offset, destination offset, blocks, blocks),
        for the copies that index whole blocks; only where the native copy does not apply."""
        pairs = np.stack([self.src_at, self.dst_at], axis=1)
        offsets, group = np.unique(pairs, axis=0, return_inverse=True)
        group = group.reshape(-1)
        return [
            (so, do, _as_slice(self.src_ids[group == g]), _as_slice(self.dst_ids[group == g]))
            for g, (so, do) in enumerate(offsets.tolist())
        ]


@functools.lru_cache(maxsize=64)  # a few token ranges per prompt length and block sizes
def _run_groups(
    t0: int, t1: int, src_bs: int, dst_bs: int, dst_t0: int | None
) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """`plan_token_runs` grouped by run length: (length, indices into the source's block
    list, offsets in those blocks, the same for the destination). Block ids apart, every
    request of a length shares it."""
    runs = plan_token_runs(t0, t1, src_bs, dst_bs, dst_t0)
    return [
        (n, runs[sel, 0], runs[sel, 2], runs[sel, 1], runs[sel, 3])
        for n in np.unique(runs[:, 4]).tolist()
        for sel in [runs[:, 4] == n]
    ]


def _batches(
    t0: int, t1: int, src_bs: int, dst_bs: int, dst_t0: int | None,
    src_blocks: Sequence[int], dst_blocks: Sequence[int], src_n: int, dst_n: int,
) -> list[_Batch]:  # fmt: skip
    """``copy_layers``' runs grouped by length, each group one native copy: a few groups
    (one when the block sizes match or divide), however many blocks. The block ids must
    lie in ``[0, src_n)`` and ``[0, dst_n)``: they are copied by address."""
    src, dst = np.asarray(src_blocks, dtype=np.int64), np.asarray(dst_blocks, dtype=np.int64)
    return [  # only the ids a run uses: a list may reach past a staged window's blocks
        _Batch(n, _ids_within(src[si], src_n), sa, _ids_within(dst[di], dst_n), da)
        for n, si, sa, di, da in _run_groups(t0, t1, src_bs, dst_bs, dst_t0)
    ]


def _ids_within(ids: np.ndarray, n: int) -> np.ndarray:
    if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < n:
        raise IndexError(f"block ids {int(ids.min())}..{int(ids.max())} outside 0..{n - 1}")
    return ids


def _as_slice(idx: np.ndarray) -> _Index:
    """``idx`` as a slice when it steps evenly upwards (indexing by it makes a view)."""
    step = int(idx[1] - idx[0]) if len(idx) > 1 else 1
    if step < 1 or not bool((np.diff(idx) == step).all()):
        return torch.from_numpy(idx.copy())
    return slice(int(idx[0]), int(idx[-1]) + 1, step)


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(source block, destination block, count) runs of blocks consecutive on both sides."""
    pairs = enumerate(zip(src_blocks, dst_blocks, strict=True))  # a run's pairs share s - i, d - i
    runs = itertools.groupby(pairs, lambda p: (p[1][0] - p[0], p[1][1] - p[0]))
    return [(s, d, 1 + len(rest)) for _, ((_, (s, d)), *rest) in runs]


def gather_tokens(kv: KV, blocks: Sequence[int], num_tokens: int) -> KV:
    """Reference: K and V of the first ``num_tokens`` tokens, ``[heads, tokens, head_dim]``."""
    used = _block_ids(blocks, 0, num_tokens, kv[0].shape[2])
    k, v = (view.transpose(0, 1).flatten(1, 2)[:, :num_tokens] for view in _canonical(kv, used))
    return k, v
