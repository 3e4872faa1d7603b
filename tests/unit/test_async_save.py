"""Saves off the engine's step: a real WorkerSide with real shared-memory staging. The step
hands its saves to the save thread; a decode that comes before the seal waits for it; vLLM
gets a request's blocks back only once every save from them is done."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from testbed.worker_processes import make_worker
from vllm_qaic_connector import region_headers
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.kv.token_copies import gather_tokens
from vllm_qaic_connector.layout import KVGeometry, blocks_for_tokens
from vllm_qaic_connector.region_headers import (
    HEADER_BYTES,
    RegionHeaders,
    StaleTicket,
    checked_read,
    header_generation,
    promised_generation,
)
from vllm_qaic_connector.step_metadata import QAICConnectorMetadata, SaveSpec
from vllm_qaic_connector.transports.shm import ShmTransport

PAGE = 4096
GEN = (7 << 32) + 3


def save_spec(request_id: str, blocks: list[int], n: int, offset: int, gen: int) -> SaveSpec:
    return SaveSpec(
        request_id=request_id, block_ids=(blocks,), num_tokens=n, staging_offset=offset,
        layout_kind="vllm_cpu_vec", block_size=32, generation=gen,
    )  # fmt: skip


@pytest.fixture
def pair():
    tag = f"qaic_kv_as{os.getpid()}_{random.randrange(1 << 30):x}"
    owner, reader = ShmTransport(f"{tag}o_r0_a", PAGE * 4), ShmTransport(f"{tag}r_r0_b", 64)
    yield owner, reader, RegionHeaders(owner.staging)
    reader.close()
    owner.close()


def test_a_reader_waits_for_a_promised_region_and_reads_what_was_sealed(pair):
    owner, reader, headers = pair
    nbytes = PAGE - HEADER_BYTES
    headers.promise(0, GEN)
    started = threading.Event()

    def late_writer() -> None:
        started.wait()
        time.sleep(0.3)  # the reader is polling by now
        with headers.writing(0, PAGE, GEN) as kv:
            kv.fill_(42)

    writer = threading.Thread(target=late_writer)
    writer.start()
    started.set()
    with checked_read(reader, owner.endpoint(), 0, nbytes, GEN) as kv:
        got = kv.clone()
    writer.join()
    assert torch.all(got == 42)
    assert promised_generation(owner.staging[:HEADER_BYTES]) == 0  # the seal kept it


def read_header_only(owner, reader) -> None:
    with checked_read(reader, owner.endpoint(), 0, 64, GEN):
        pass


def test_a_promise_never_kept_fails_after_the_bound(pair, monkeypatch):
    owner, reader, headers = pair
    monkeypatch.setattr(region_headers, "SEAL_WAIT_S", 0.2)
    headers.promise(0, GEN)
    with pytest.raises(StaleTicket, match="was not written within"):
        read_header_only(owner, reader)


def test_a_promise_for_another_generation_or_abandoned_fails_at_once(pair, monkeypatch):
    owner, reader, headers = pair
    monkeypatch.setattr(region_headers, "SEAL_WAIT_S", 60.0)
    t0 = time.monotonic()
    headers.promise(0, GEN + 1)
    with pytest.raises(StaleTicket, match="no live KV"):
        read_header_only(owner, reader)
    headers.promise(0, GEN)
    headers.abandon(0)  # a save that failed
    with pytest.raises(StaleTicket, match="no live KV"):
        read_header_only(owner, reader)
    assert time.monotonic() - t0 < 30  # neither waited out the bound


def test_the_step_does_not_wait_and_blocks_come_back_only_after_the_save(monkeypatch):
    from vllm_qaic_connector.worker import request_saves

    monkeypatch.setattr(request_saves, "INLINE_SAVE_BYTES", 0)  # every save is "large"
    args = dict(rank=0, tp=1, total_heads=2, block=32, layout="vllm_cpu_vec")
    extra = {"async_saves": True}
    worker = make_worker({**args, "engine": f"as{os.getpid()}", "extra": extra}, seed=3)
    assert worker.transport is not None and worker.saves is not None
    reader = ShmTransport(f"qaic_kv_as{os.getpid()}r_r0_{random.randrange(1 << 30):x}", 64)
    try:
        n, blocks = 70, [5, 2, 9]
        spec = save_spec("p1", blocks, n, 0, GEN)
        other = save_spec("p2", [7], 20, 1 << 20, GEN + 1)
        gate = threading.Event()
        worker.saves.saver.submit(gate.wait)  # the save thread is busy with an earlier save
        worker.bind(QAICConnectorMetadata(saves=[spec, other]))
        worker.wait_for_save()
        worker.bind(None)
        header = worker.transport.staging[:HEADER_BYTES]
        # The step returned with the save still queued, its generation promised.
        assert header_generation(header) == 0 and promised_generation(header) == GEN
        worker.bind(QAICConnectorMetadata(await_saves=["p1"]))  # p1 finished; p2 runs on
        assert worker.get_finished() == (None, None)
        gate.set()
        deadline, sent = time.monotonic() + 30, None
        while sent is None and time.monotonic() < deadline:
            sent, _ = worker.get_finished()
            time.sleep(0.01)
        assert sent == {"p1"}  # never p2: vLLM would free a running request's blocks
        assert worker.get_finished() == (None, None)
        geo = KVGeometry(2, 32, 32, torch.float32)
        fmt = StagingFormat("vllm_cpu_vec", geo, len(worker.layers))
        staged = list(range(blocks_for_tokens(n, 32)))
        with checked_read(reader, worker.transport.endpoint(), 0, fmt.request_bytes(n), GEN) as r:
            views = fmt.layer_views(r, n)
            for src, dst in zip(worker.layers, views, strict=True):
                want, got = gather_tokens(src, blocks, n), gather_tokens(dst, staged, n)
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    finally:
        reader.close()
        worker.shutdown()


@pytest.mark.parametrize("inline_bytes", [1 << 20, 1024])
def test_a_small_save_runs_in_the_step_a_large_one_on_the_save_thread(monkeypatch, inline_bytes):
    """With the save thread idle, a step whose saves copy at most `INLINE_SAVE_BYTES`
    stages them before the step returns (sealed, no promise: the thread hand-off would
    cost more than the copy); a larger one still goes to the save thread. Either way the
    staged bytes are the cache's and vLLM gets the blocks back once the save is done."""
    from vllm_qaic_connector.worker import request_saves

    monkeypatch.setattr(request_saves, "INLINE_SAVE_BYTES", inline_bytes)
    args = dict(rank=0, tp=1, total_heads=2, block=32, layout="vllm_cpu_vec")
    extra = {"async_saves": True}
    worker = make_worker({**args, "engine": f"in{os.getpid()}", "extra": extra}, seed=4)
    assert worker.transport is not None and worker.saves is not None
    saves = worker.saves
    ran_on: list[str] = []
    real_save = saves._save

    def save(spec: SaveSpec) -> None:
        ran_on.append(threading.current_thread().name)
        real_save(spec)

    monkeypatch.setattr(saves, "_save", save)
    reader = ShmTransport(f"qaic_kv_in{os.getpid()}r_r0_{random.randrange(1 << 30):x}", 64)
    try:
        n, blocks = 70, [5, 2, 9]  # 70 tokens x 2 layers x 2 heads x 32 x fp32 x K,V: 70 KiB
        spec = save_spec("p1", blocks, n, 0, GEN)
        worker.bind(QAICConnectorMetadata(saves=[spec]))
        worker.wait_for_save()
        inline = inline_bytes >= 70 << 10
        if inline:  # sealed before the step returned, on the engine's thread
            header = worker.transport.staging[:HEADER_BYTES]
            assert header_generation(header) == GEN and promised_generation(header) == 0
            assert ran_on == [threading.current_thread().name]
        worker.bind(QAICConnectorMetadata(await_saves=["p1"]))
        deadline, sent = time.monotonic() + 30, None
        while sent is None and time.monotonic() < deadline:
            sent, _ = worker.get_finished()
            time.sleep(0.01)
        assert sent == {"p1"}
        if not inline:
            assert ran_on and ran_on[0].startswith("qaic-kv-save")
        geo = KVGeometry(2, 32, 32, torch.float32)
        fmt = StagingFormat("vllm_cpu_vec", geo, len(worker.layers))
        staged = list(range(blocks_for_tokens(n, 32)))
        with checked_read(reader, worker.transport.endpoint(), 0, fmt.request_bytes(n), GEN) as r:
            for src, dst in zip(worker.layers, fmt.layer_views(r, n), strict=True):
                want, got = gather_tokens(src, blocks, n), gather_tokens(dst, staged, n)
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    finally:
        reader.close()
        worker.shutdown()


def test_a_preempted_request_s_save_finishes_before_the_forward_reuses_its_blocks(monkeypatch):
    """vLLM frees a preempted request's blocks at once, and the next forward may write
    another request's KV into them. Through the connector's ``handle_preemptions`` (what
    vLLM's model runner calls before that forward), a chunk still queued on the save
    thread is staged from the blocks as they were: the bytes written after it returns
    never reach the staging."""
    from vllm_qaic_connector.connector import QAICConnector
    from vllm_qaic_connector.worker import request_saves

    monkeypatch.setattr(request_saves, "INLINE_SAVE_BYTES", 0)
    args = dict(rank=0, tp=1, total_heads=2, block=32, layout="vllm_cpu_vec")
    extra = {"async_saves": True}
    worker = make_worker({**args, "engine": f"pr{os.getpid()}", "extra": extra}, seed=5)
    assert worker.transport is not None and worker.saves is not None
    connector = QAICConnector.__new__(QAICConnector)  # its worker half only
    connector.worker = worker
    reader = ShmTransport(f"qaic_kv_pr{os.getpid()}r_r0_{random.randrange(1 << 30):x}", 64)
    try:
        n, blocks = 64, [5, 2]
        want = [gather_tokens(layer, blocks, n) for layer in worker.layers]
        gate = threading.Event()
        worker.saves.saver.submit(gate.wait)  # the save thread is busy with an earlier save
        worker.bind(QAICConnectorMetadata(saves=[save_spec("p1", blocks, n, 0, GEN)]))
        worker.wait_for_save()  # the chunk is queued behind it
        worker.bind(None)
        threading.Timer(0.3, gate.set).start()
        connector.handle_preemptions(QAICConnectorMetadata(preempted=["p1"]))
        for layer in worker.layers:  # the next forward: another request's KV in p1's blocks
            for plane in layer:
                plane[blocks] = -1.0
        geo = KVGeometry(2, 32, 32, torch.float32)
        fmt = StagingFormat("vllm_cpu_vec", geo, len(worker.layers))
        staged = list(range(blocks_for_tokens(n, 32)))
        with checked_read(reader, worker.transport.endpoint(), 0, fmt.request_bytes(n), GEN) as r:
            for (k, v), dst in zip(want, fmt.layer_views(r, n), strict=True):
                got = gather_tokens(dst, staged, n)
                assert torch.equal(k, got[0]) and torch.equal(v, got[1])
    finally:
        gate.set()
        reader.close()
        worker.shutdown()
