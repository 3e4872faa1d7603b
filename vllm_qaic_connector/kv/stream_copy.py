"""Copies of many byte ranges, with non-temporal stores where the optional native
`_stream_copy` was built (a C compiler at install), else with memmove per range; and the
native copies of strided blocks (`BlockRows`, `BlockTiles`; `layout` plans them). All
release the GIL, so two threads copy in parallel."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

try:
    from vllm_qaic_connector.kv._stream_copy import copy_blocks as _native_blocks
    from vllm_qaic_connector.kv._stream_copy import copy_ranges as _native
    from vllm_qaic_connector.kv._stream_copy import copy_tiles as _native_tiles
except ImportError:  # installed without a C compiler
    _native = _native_blocks = _native_tiles = None

NATIVE = _native is not None


def copy_threads() -> int:
    """Threads worth copying with: one per core this process may use, at most two (two
    already reach this host's memory bandwidth); one on an engine pinned to its core."""
    return min(2, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class BlockRows:
    """One block's copy as rows of ``chunk`` contiguous bytes on both sides: row (a, b)
    at ``a * stride_a + b * stride_b`` from each block's start (strides in bytes). The
    fields are `_stream_copy.copy_blocks`' arguments, in order."""

    rows_a: int
    rows_b: int
    chunk: int
    dst_a: int
    dst_b: int
    src_a: int
    src_b: int

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copies the rows of each block at address ``src[i]`` to the block at ``dst[i]``."""
        _run(_native_blocks, src, dst, self)


@dataclass(frozen=True)
class BlockTiles:
    """One block's copy as a transpose: element (o, r, c) of ``item`` bytes at
    ``o * o_stride + r * r_stride + c * c_stride`` from each block's start (bytes), ``r``
    contiguous in the source and ``c`` in the destination. The fields are
    `_stream_copy.copy_tiles`' arguments, in order."""

    n_o: int
    n_r: int
    n_c: int
    item: int
    dst_o: int
    dst_r: int
    dst_c: int
    src_o: int
    src_r: int
    src_c: int

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copies each block at address ``src[i]`` to the block at ``dst[i]``."""
        _run(_native_tiles, src, dst, self)


def _run(copy: Callable[..., None] | None, src: np.ndarray, dst: np.ndarray, plan: object) -> None:
    assert copy is not None, "block plans need the native _stream_copy (layout checks NATIVE)"
    copy(np.ascontiguousarray(dst, dtype=np.uint64), np.ascontiguousarray(src, dtype=np.uint64),
           *vars(plan).values())  # fmt: skip


def copy_ranges(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> int:
    """Copies ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]``; returns the bytes.
    The caller vouches for every address (see `byte_runs.block_ranges`)."""
    src, dst, nbytes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (src, dst, nbytes))
    if _native is not None:
        _native(dst, src, nbytes)
    else:
        for s, d, n in zip(src.tolist(), dst.tolist(), nbytes.tolist(), strict=True):
            ctypes.memmove(d, s, n)
    return int(nbytes.sum())
