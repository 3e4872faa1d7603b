"""Copies of many byte ranges, with non-temporal stores where the optional native
`_stream_copy` was built (a C compiler at install), else with memmove per range. Both
release the GIL, so two threads copy in parallel."""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm_qaic_connector.layout import BlockRows, BlockTiles

try:
    from vllm_qaic_connector._stream_copy import copy_blocks as _native_blocks
    from vllm_qaic_connector._stream_copy import copy_ranges as _native
    from vllm_qaic_connector._stream_copy import copy_tiles as _native_tiles
except ImportError:  # installed without a C compiler
    _native = _native_blocks = _native_tiles = None

NATIVE = _native is not None


def copy_threads() -> int:
    """Threads worth copying with: one per core this process may use, at most two (two
    already reach this host's memory bandwidth); one on an engine pinned to its core."""
    return min(2, len(os.sched_getaffinity(0)))


def copy_blocks(src: np.ndarray, dst: np.ndarray, rows: BlockRows) -> None:
    """Copies ``rows`` of each block at address ``src[i]`` to the block at ``dst[i]``
    (native only: `layout.copy_tokens` goes through numpy without it)."""
    assert _native_blocks is not None, "copy_blocks needs the native _stream_copy"
    r = rows
    _native_blocks(np.ascontiguousarray(dst, dtype=np.uint64),
                   np.ascontiguousarray(src, dtype=np.uint64),
                   r.rows_a, r.rows_b, r.chunk, r.dst_a, r.dst_b, r.src_a, r.src_b)  # fmt: skip


def copy_tiles(src: np.ndarray, dst: np.ndarray, tiles: BlockTiles) -> None:
    """Copies each block at address ``src[i]`` to the block at ``dst[i]`` element by
    element as ``tiles`` says (native only, like `copy_blocks`)."""
    assert _native_tiles is not None, "copy_tiles needs the native _stream_copy"
    t = tiles
    _native_tiles(np.ascontiguousarray(dst, dtype=np.uint64),
                  np.ascontiguousarray(src, dtype=np.uint64), t.n_o, t.n_r, t.n_c, t.item,
                  t.dst_o, t.dst_r, t.dst_c, t.src_o, t.src_r, t.src_c)  # fmt: skip


def copy_ranges(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> int:
    """Copies ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]``; returns the bytes.
    The caller vouches for every address (see `layout.block_ranges`)."""
    src, dst, nbytes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (src, dst, nbytes))
    if _native is not None:
        _native(dst, src, nbytes)
    else:
        for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist(), strict=True):
            ctypes.memmove(d, s, n)
    return int(nbytes.sum())
