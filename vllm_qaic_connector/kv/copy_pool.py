"""A second thread for big KV copies, where this process may use two cores: one copy
thread reaches about half of this host's memory bandwidth, two reach most of it. A big
copy splits its work in two and runs one half there; a small one, and every copy on an
engine pinned to one core, runs where it is called. A copy to or from GPU memory goes to
`DeviceCopies` instead."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from vllm_qaic_connector.kv.device_copies import DeviceCopies
from vllm_qaic_connector.kv.stream_copy import copy_threads
from vllm_qaic_connector.kv.token_copies import HeadRange, copy_layers, tokens_bytes
from vllm_qaic_connector.layout import KV

# Below this a copy runs whole where it is called: handing half of it to the other thread
# costs more than it saves (a 128 KiB save took 0.46 ms split, 0.24 ms on one thread).
SPLIT_MIN_BYTES = 4 << 20


class CopyPool:
    def __init__(self) -> None:
        two = copy_threads() > 1
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="qaic-kv-copy") if two else None
        self._idle = threading.Lock()  # held while the second thread copies
        self.device = DeviceCopies()

    def split(
        self, work: Callable[[int, int], int], n: int, nbytes: int, at: int | None = None
    ) -> int:
        """``work(0, at) + work(at, n)``, the second half on the other thread (``at``
        defaults to ``n // 2``); ``work`` returns the bytes it copied, ``nbytes`` in all.
        Under `SPLIT_MIN_BYTES`, or where that thread is busy with another copy, the whole
        copy runs here: a small load never queues behind a big one's half."""
        at = n // 2 if at is None else at
        whole = nbytes < SPLIT_MIN_BYTES or not 0 < at < n  # too small, or nothing to split
        if self._pool is None or whole or not self._idle.acquire(blocking=False):  # or busy
            return work(0, n)
        try:
            second = self._pool.submit(work, at, n)
        except BaseException:
            self._idle.release()
            raise
        second.add_done_callback(lambda _: self._idle.release())
        return work(0, at) + second.result()

    def layers(
        self, src: Sequence[KV], src_blocks: Sequence[int], dst: Sequence[KV],
        dst_blocks: Sequence[int], t0: int, t1: int, heads: HeadRange | None = None,
        dst_t0: int | None = None,
    ) -> int:  # fmt: skip
        """`copy_layers`, the second half of the layers on the other thread."""
        if src and dst and (src[0][0].is_cuda or dst[0][0].is_cuda):
            return self.device.layers(src, src_blocks, dst, dst_blocks, t0, t1, heads, dst_t0)

        def part(i: int, j: int) -> int:
            return copy_layers(src[i:j], src_blocks, dst[i:j], dst_blocks, t0, t1, heads, dst_t0)

        return self.split(part, len(dst), tokens_bytes(dst, t0, t1, heads))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
