"""A prefill rank's saves: each step's `SaveSpec`s copied from its KV cache into staging
under their tickets' headers, off the engine's step, and which finished requests' blocks
vLLM may free because nothing reads them any more."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vllm_qaic_connector.config import ConnectorConfig
from vllm_qaic_connector.kv.copy_pool import CopyPool
from vllm_qaic_connector.kv.token_copies import layer_runs, tokens_bytes
from vllm_qaic_connector.layout import blocks_for_tokens
from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.region_headers import HEADER_BYTES, RegionHeaders
from vllm_qaic_connector.stats import QAICConnectorStats
from vllm_qaic_connector.step_metadata import QAICConnectorMetadata, SaveSpec
from vllm_qaic_connector.worker.registration import LocalCache

logger = get_logger(__name__)

# A step whose saves copy at most this many bytes stages them inside the step when the
# save thread is idle: handing them over costs more (a wake-up, then the two threads
# trading the GIL through the engine's forward) than the copy. The tiny model's 250-token
# prompt is 128 KiB; one token of a Llama-3-8B is 128 KiB, so real prompts go to the thread.
INLINE_SAVE_BYTES = 1 << 20


class RequestSaves:
    def __init__(
        self, cfg: ConnectorConfig, cache: LocalCache, headers: RegionHeaders, copies: CopyPool
    ) -> None:
        self.cfg, self.cache, self.headers, self._copies = cfg, cache, headers, copies
        # Saves leave the engine's step: one thread, so a request's chunks land in order.
        self.saver = ThreadPoolExecutor(1, thread_name_prefix="qaic-kv-save")
        self._saving: dict[str, Future[None]] = {}  # each request's latest save
        self._last_job: Future[None] | None = None  # the save thread runs jobs in order
        self._await_saves: set[str] = set()  # finished; vLLM holds their blocks for us
        self._released_direct: set[str] = set()  # handed off directly; tickets invalidated
        self._stats = QAICConnectorStats()
        self._stats_lock = threading.Lock()

    def run(self, step: QAICConnectorMetadata) -> None:
        """Stages this step's saves; with ``async_saves``, hands them to the save thread
        and returns. Then, before the ticket can leave, each sealing save promises its
        generation, so a decode that comes early waits for the seal instead of failing."""
        for offset in step.invalidate:
            self.headers.invalidate(offset)
        self._released_direct.update(step.release_direct)
        for spec in step.saves:
            if spec.direct and spec.generation:
                self._seal_direct(spec)
        saves = [spec for spec in step.saves if not spec.direct]
        forward = self._copies.device.forward_done(self.cache.device) if saves else None
        if not saves or not self.cfg.async_saves or self._inline(saves):
            self._save_all(saves, forward)
            return
        for spec in saves:
            if spec.generation:
                self.headers.promise(spec.staging_offset, spec.generation)
        job = self._last_job = self.saver.submit(self._save_all, saves, forward)
        self._saving.update((spec.request_id, job) for spec in saves)

    def _inline(self, saves: list[SaveSpec]) -> bool:
        """Small enough to copy in the step (`INLINE_SAVE_BYTES`), and nothing queued
        that an earlier chunk of the same request could be in."""
        if self._last_job is not None and not self._last_job.done():
            return False
        layers = self.cache.layers
        nbytes = sum(tokens_bytes(layers, s.first, s.last or s.num_tokens) for s in saves)
        return nbytes <= INLINE_SAVE_BYTES

    def finish(self, request_ids: list[str]) -> None:
        """Waits for the saves still reading these requests' blocks (vLLM's
        ``handle_preemptions``: the blocks go to other requests in this step)."""
        for rid in request_ids:
            if (job := self._saving.get(rid)) is not None:
                job.result()

    def hold(self, request_ids: list[str]) -> None:
        """Finished requests whose blocks vLLM holds until their saves are done."""
        self._await_saves.update(request_ids)

    def finished_sending(self) -> set[str]:
        """Requests whose blocks vLLM may free: saves all done, or direct tickets gone."""
        done = {r for r in self._await_saves if (f := self._saving.get(r)) is None or f.done()}
        self._await_saves -= done
        for rid in done:
            self._saving.pop(rid, None)
        released, self._released_direct = self._released_direct, set()
        return done | released

    def take_stats(self) -> QAICConnectorStats:
        with self._stats_lock:
            out, self._stats = self._stats, QAICConnectorStats()
            return out

    def shutdown(self) -> None:
        self.saver.shutdown(wait=True)  # its writes go into the transport's staging

    def _save_all(self, saves: list[SaveSpec], forward: torch.cuda.Event | None) -> None:
        """``forward``: what wrote the blocks, on a GPU; the copies wait for it."""
        with self._copies.device.after(forward, self.cache.device):
            for spec in saves:
                try:
                    self._save(spec)
                except Exception:
                    logger.exception("QAICConnector: staging request %s failed", spec.request_id)
                    self.headers.abandon(spec.staging_offset)  # its reader fails at once

    def _seal_direct(self, spec: SaveSpec) -> None:
        """Nothing to copy: the ticket's header says the held blocks are ready. On the
        engine thread, so no seal can land after the release that invalidates it."""
        start, t0 = spec.staging_offset, time.monotonic()
        with self.headers.writing(start, start + HEADER_BYTES, spec.generation, spec.binding):
            pass
        self._record(spec, 0, t0)

    def _save(self, spec: SaveSpec) -> None:
        """Copy a prompt's KV (or a chunk of it) into staging; the cache is only read."""
        cache = self.cache
        geometry = dataclasses.replace(cache.geometry, block_size=spec.block_size)
        fmt = cache.staging_format(spec.layout_kind, geometry, spec.starts)
        start = spec.staging_offset
        end = start + HEADER_BYTES + fmt.request_bytes(spec.num_tokens)
        staged_blocks = list(range(blocks_for_tokens(spec.num_tokens, fmt.geometry.block_size)))
        written, t0 = 0, time.monotonic()
        with self.headers.writing(start, end, spec.generation, spec.binding) as region:
            views = fmt.layer_views(region, spec.num_tokens)
            last = spec.last or spec.num_tokens
            for (group, shift), layers in layer_runs(len(views), cache.group, fmt.shift):
                t = max(spec.starts[group], spec.first)  # staged from the shift on
                if t < last:
                    written += self._copies.layers(
                        cache.layers[layers], spec.block_ids[group], views[layers],
                        staged_blocks, t, last, dst_t0=t - shift,
                    )  # fmt: skip
            if cache.state is not None and spec.generation:  # the state after the last token
                staged_state = fmt.state_region(region, spec.num_tokens)
                written += cache.state.save(spec.block_ids, staged_state)
        self._record(spec, written, t0)

    def _record(self, spec: SaveSpec, written: int, t0: float) -> None:
        with self._stats_lock:
            if spec.generation:  # the prompt's last part
                self._stats.add("saved_requests")
                self._stats.add("saved_tokens", spec.num_tokens)
            self._stats.add("bytes_copied", written)
            self._stats.sample("save_seconds", time.monotonic() - t0)
