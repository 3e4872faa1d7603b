"""KV copies between a KV cache in GPU memory and host staging.

The host side of a copy is mirrored in device memory a few layers at a time (at most
`SCRATCH_BYTES` a piece), converted there by `copy_layers` at device speed, and moved by
one async copy per contiguous host run: a few large DMAs per request, not one blocking
copy per layer and plane. Page-locked host memory (`host_pinning`) lets them run at PCIe
speed.

Ordering, the guarantee: the copies run on the calling thread's own stream. A save's
stream first waits for the event the engine recorded after its forward (`after`), so it
never reads blocks the forward is still writing. Every call returns only once its copies
completed (its own event, not a device-wide sync): a load's blocks are whole before vLLM
hears of them, and a staging region is reused only after its device-to-host copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

from vllm_qaic_connector.kv.token_copies import HeadRange, copy_layers, tokens_bytes
from vllm_qaic_connector.layout import KV

SCRATCH_BYTES = 256 << 20  # device memory a copy borrows beside vLLM's KV cache


class DeviceCopies:
    def __init__(self) -> None:
        self._local = threading.local()  # each copying thread's stream

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if (stream := getattr(self._local, "stream", None)) is None:
            stream = self._local.stream = torch.cuda.Stream(device)
        return stream

    @staticmethod
    def forward_done(device: torch.device) -> torch.cuda.Event | None:
        """An event after the work queued so far on the engine's stream (None on a CPU)."""
        return torch.cuda.current_stream(device).record_event() if device.type == "cuda" else None

    @contextlib.contextmanager
    def after(self, event: torch.cuda.Event | None, device: torch.device) -> Iterator[None]:
        """This thread's copies, state copies included, wait for ``event``."""
        if event is None:
            yield
            return
        stream = self._stream(device)
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            yield

    def layers(
        self, src: Sequence[KV], src_blocks: Sequence[int], dst: Sequence[KV],
        dst_blocks: Sequence[int], t0: int, t1: int, heads: HeadRange | None = None,
        dst_t0: int | None = None,
    ) -> int:  # fmt: skip
        """`copy_layers` where one side (or both) lies in GPU memory; returns when done."""
        device = (src if src[0][0].is_cuda else dst)[0][0].device
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            if src[0][0].is_cuda and dst[0][0].is_cuda:
                copy_layers(src, src_blocks, dst, dst_blocks, t0, t1, heads, dst_t0)
            else:
                mirrored_copy(src, src_blocks, dst, dst_blocks, t0, t1, heads, dst_t0,
                              saving=src[0][0].is_cuda, device=device)  # fmt: skip
            done = stream.record_event()
        done.synchronize()
        return tokens_bytes(dst, t0, t1, heads)


def mirrored_copy(
    src: Sequence[KV], src_blocks: Sequence[int], dst: Sequence[KV], dst_blocks: Sequence[int],
    t0: int, t1: int, heads: HeadRange | None, dst_t0: int | None, *, saving: bool,
    device: torch.device,
) -> None:  # fmt: skip
    """`copy_layers` with the host side (``dst`` when ``saving``, else ``src``; staging, its
    blocks consecutive) mirrored on ``device``: the mirror is filled from the host where
    the copy does not overwrite all of it, and written back to the host after a save, the
    tokens past the last in its last block zeroed (never stale device memory)."""
    host, blocks = (dst, dst_blocks) if saving else (src, src_blocks)
    first = (t0 if dst_t0 is None else dst_t0) if saving else t0
    size = host[0][0].shape[2]
    used = [int(b) for b in blocks[first // size : -(-(first + t1 - t0) // size)]]
    lo = used[0]
    if used != list(range(lo, lo + len(used))):
        raise ValueError(f"staged blocks {used[:4]}... are not consecutive")
    host = [(k[lo : lo + len(used)], v[lo : lo + len(used)]) for k, v in host]
    shifted = [int(b) - lo for b in blocks]
    per_layer = 2 * host[0][0].numel() * host[0][0].element_size()
    step = max(1, SCRATCH_BYTES // max(1, per_layer))
    for i in range(0, len(host), step):
        mirror, runs, exact = _mirror(host[i : i + step], device)
        if not saving or not exact or first % size or heads is not None:
            for on_host, on_device in runs:  # what the copy leaves must stay as it is
                on_device.copy_(on_host, non_blocking=True)
        if saving:
            copy_layers(src[i : i + step], src_blocks, mirror, shifted, t0, t1, heads, dst_t0)
            if tail := (first + t1 - t0) % size:  # the last block's unused tokens: zeros
                for plane in (p for kv in mirror for p in kv):
                    plane[len(used) - 1, :, tail:] = 0
            for on_host, on_device in runs:
                on_host.copy_(on_device, non_blocking=True)
        else:
            copy_layers(mirror, shifted, dst[i : i + step], dst_blocks, t0, t1, heads, dst_t0)


def _mirror(
    views: Sequence[KV], device: torch.device
) -> tuple[list[KV], list[tuple[torch.Tensor, torch.Tensor]], bool]:
    """Device views over a buffer holding the host memory under ``views``; its (host,
    device) byte runs; whether the runs hold only the views' bytes."""
    spans: list[list[int]] = []
    for start, end in sorted(_span(t) for kv in views for t in kv):
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    total = sum(end - start for start, end in spans)
    scratch = torch.empty(total, dtype=torch.uint8, device=device)
    whole = torch.empty(0, dtype=torch.uint8).set_(views[0][0].untyped_storage())
    base, at, runs, starts = whole.data_ptr(), 0, [], []
    for start, end in spans:
        runs.append((whole[start - base : end - base], scratch[at : at + end - start]))
        starts.append((start, at))
        at += end - start

    def on_device(t: torch.Tensor) -> torch.Tensor:
        start, offset = next(s for s in reversed(starts) if s[0] <= t.data_ptr())
        where = (offset + t.data_ptr() - start) // t.element_size()
        return torch.as_strided(scratch.view(t.dtype), t.shape, t.stride(), where)

    exact = total == sum(t.numel() * t.element_size() for kv in views for t in kv)
    return [(on_device(k), on_device(v)) for k, v in views], runs, exact


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte addresses ``[start, end)`` that a strided view reaches."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
