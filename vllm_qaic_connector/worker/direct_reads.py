"""Direct reads: a decode copies a prompt's KV blocks straight out of the prefill's KV cache.

On one host, staging the KV is a copy for nothing: the decode can copy (and convert, where
layouts or block sizes differ) straight out of the prefill's cache, one pass instead of two.
The prefill makes its KV cache readable once, when it is registered: over shm it moves it
into shared memory (torch swaps the storage under every view of it, so vLLM's kernels write
into shared memory from then on); over NIXL it registers it with its agent.
A handed-off request's blocks stay held until the decode acknowledges or the lease ends.
Its ticket is a header-only staging region, which the prefill invalidates before vLLM may
reuse the blocks; the decode checks it before and after its copy (`region_headers.checked_read`),
so a late copy is a load error, never wrong KV.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import select
import threading
import warnings
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from vllm_qaic_connector.kv.byte_runs import BlockExtents, ByteRun, block_ranges, merged
from vllm_qaic_connector.kv.copy_pool import CopyPool
from vllm_qaic_connector.kv.stream_copy import copy_ranges
from vllm_qaic_connector.kv.token_copies import block_runs
from vllm_qaic_connector.layout import KVGeometry, KVLayout
from vllm_qaic_connector.protocol.wire import RankMetadata, SharedCache, TransportEndpoint
from vllm_qaic_connector.worker.registration import LocalCache

FD_PATH_RE = re.compile(r"/proc/([0-9]+)/fd/[0-9]+")


def dense_blocks(cache: LocalCache) -> bool:
    """Whether each block of the cache's layers is one run of memory."""
    layer = cache.tensors[0]
    with contextlib.suppress(ValueError):
        return bool(BlockExtents.of(layer.shape, layer.stride(), cache.layout.block_dim))
    return False


def cache_ranges(
    cache: SharedCache,
    layout: KVLayout,
    src_bases: Sequence[int],
    layers: Sequence[torch.Tensor],
    blocks: tuple[Sequence[int], Sequence[int]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`block_ranges` of every layer: (source, destination, bytes) of (prefill blocks, our
    blocks) from the prefill's layers of ``cache`` at ``src_bases`` into our ``layers``."""
    dim = layout.block_dim
    limits = (cache.shape[dim], layers[0].shape[dim])
    for name, ids, n in zip(("prefill", "our"), blocks, limits, strict=True):
        if ids and not 0 <= min(ids) <= max(ids) < n:  # copies go by address
            raise ValueError(f"{name} block ids {min(ids)}..{max(ids)} outside 0..{n - 1}")
    first = layers[0]
    if any((t.shape, t.stride()) != (first.shape, first.stride()) for t in layers):
        raise ValueError("direct reads need our layers in one shape and stride")
    theirs = BlockExtents.of(cache.shape, cache.strides, dim)
    ours = BlockExtents.of(first.shape, first.stride(), dim)
    frm, to, sizes = block_ranges(theirs, ours, block_runs(*blocks), first.element_size())
    # The layers share one plan, shifted to each layer's base; range by range, every layer
    # in turn, so a cross-layer layout's block of every layer joins into one range.
    src_at = frm[:, None] + np.asarray(src_bases, dtype=np.int64)
    dst_at = to[:, None] + np.asarray([t.data_ptr() for t in layers], dtype=np.int64)
    return merged(src_at.ravel(), dst_at.ravel(), np.repeat(sizes, len(layers)))


def plan_cache_reads(
    cache: SharedCache,
    layout: KVLayout,
    layers: Sequence[torch.Tensor],
    blocks: tuple[Sequence[int], Sequence[int]],
) -> list[ByteRun]:
    """NIXL runs for (prefill blocks, our blocks) of every layer: the source offset in the
    prefill's cache, the destination address in ours."""
    item = layers[0].element_size()
    ranges = cache_ranges(cache, layout, [o * item for o in cache.layer_offsets], layers, blocks)
    return [ByteRun(*r) for r in zip(*(a.tolist() for a in ranges), strict=True)]


def cache_endpoint(staging: TransportEndpoint, cache: SharedCache) -> TransportEndpoint:
    """A prefill rank's registered KV cache as a region to read, like its ``staging``."""
    address = f"{staging.owner}@{cache.address:#x}"
    return msgspec.structs.replace(staging, address=address, size=cache.size, device=cache.device)


def owner_of(rank: RankMetadata) -> str:
    return f"{rank.incarnation}/{rank.tp_rank}"


class PeerCache:
    """A prefill rank's shared KV cache, mapped read-only: canonical views per layer, and
    where each layer's blocks lie. Dropped once the prefill process is gone: the mapping
    alone would keep its memory."""

    def __init__(self, cache: SharedCache, layout: KVLayout, geometry: KVGeometry) -> None:
        if not (match := FD_PATH_RE.fullmatch(cache.path)):
            raise ConnectionError(f"shared KV cache path {cache.path!r} is not /proc/<pid>/fd/<n>")
        try:  # the process first: a pidfd names it even if its pid is reused later
            self._pidfd = os.pidfd_open(int(match[1]))
            fd = os.open(cache.path, os.O_RDONLY)  # reopens the prefill's unlinked shm object
        except OSError as exc:
            raise ConnectionError(f"cannot open the prefill's KV cache: {exc}") from None
        try:
            st = os.fstat(fd)
            if st.st_ino != cache.inode:
                raise ConnectionError("the prefill's KV cache is not the object it advertised")
            if st.st_size < cache.size:
                raise ConnectionError("the prefill's KV cache is smaller than advertised")
            self._map = mmap.mmap(fd, cache.size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(self._pidfd)
            raise
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only on purpose: see transports/shm.py
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
            flat = torch.frombuffer(self._map, dtype=torch.uint8).view(geometry.dtype)
        try:  # as_strided refuses a shape or offset outside the mapping
            tensors = [flat.as_strided(cache.shape, cache.strides, o) for o in cache.layer_offsets]
            BlockExtents.of(cache.shape, cache.strides, layout.block_dim)  # whole blocks to copy
        except (RuntimeError, ValueError) as exc:
            os.close(self._pidfd)
            raise ConnectionError(f"the prefill's KV cache does not fit its map: {exc}") from None
        self.cache, self.layout = cache, layout
        self.layers = [layout.kv_views(t, geometry) for t in tensors]
        self.addresses = [t.data_ptr() for t in tensors]

    def alive(self) -> bool:
        return not select.select([self._pidfd], [], [], 0)[0]  # readable once it exited

    def close(self) -> None:
        os.close(self._pidfd)


class DirectReader:
    """Peers' caches, mapped once each, and the copy out of them."""

    def __init__(self, copies: CopyPool) -> None:
        self._caches: dict[str, PeerCache] = {}
        self._lock = threading.Lock()
        self._copies = copies

    def peer(
        self, owner: str, cache: SharedCache, layout: KVLayout, geometry: KVGeometry
    ) -> PeerCache:
        """``owner`` names the prefill rank and its start (`owner_of`)."""
        with self._lock:
            if owner not in self._caches:
                self._caches[owner] = PeerCache(cache, layout, geometry)
            return self._caches[owner]

    def forget(self, owner: str) -> None:
        with self._lock:
            cache = self._caches.pop(owner, None)
        if cache is not None:
            cache.close()

    def drop_dead(self) -> None:
        """Unmaps the caches of prefills that exited (cheap: a poll per mapped cache)."""
        with self._lock:
            dead = [owner for owner, cache in self._caches.items() if not cache.alive()]
        for owner in dead:
            self.forget(owner)

    def copy(
        self,
        src: PeerCache,
        src_blocks: Sequence[int],
        dst: Sequence[torch.Tensor],
        dst_blocks: Sequence[int],
    ) -> int:
        """Copies whole blocks from ``src`` into ``dst``, our layers as vLLM registered them
        (the same layout); a second thread takes the ranges of the second half of the bytes."""
        blocks = (src_blocks, dst_blocks)
        frm, to, sizes = cache_ranges(src.cache, src.layout, src.addresses, dst, blocks)
        half = int(np.searchsorted(np.cumsum(sizes), sizes.sum() // 2))

        def part(lo: int, hi: int) -> int:
            return copy_ranges(frm[lo:hi], to[lo:hi], sizes[lo:hi])

        return self._copies.split(part, len(sizes), int(sizes.sum()), half)

    def close(self) -> None:
        for owner in list(self._caches):
            self.forget(owner)
