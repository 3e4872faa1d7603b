"""Copies of many byte ranges, with non-temporal stores where the optional native
`_stream_copy` was built (a C compiler at install), else with memmove per range. Both
release the GIL, so two threads copy in parallel."""

from __future__ import annotations

import ctypes

import numpy as np

try:
    from vllm_qaic_connector._stream_copy import copy_ranges as _native
except ImportError:  # installed without a C compiler
    _native = None

NATIVE = _native is not None


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
