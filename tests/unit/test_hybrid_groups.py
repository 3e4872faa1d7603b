"""Hybrid models (several KV cache groups): the window math against vLLM's own managers, and
the scheduler half inside real vLLM Schedulers whose KV cache has a sliding-window group."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.outputs import KVConnectorOutput

from testbed.handshake_ranks import rank_meta
from testbed.vllm_harness import make_request, make_scheduler, meta, params_of, remote_params, step
from vllm_qaic_connector.kv.kv_groups import KVGroup, staged_starts, tokens_to_load, window_start

BS, WINDOW = 16, 32


@pytest.mark.parametrize("window", [1, 7, 32, 64, 100])
def test_window_start_is_vllms_rule(window):
    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    for n in range(0, 300, 7):
        assert window_start(n, window) == SlidingWindowManager.get_num_skipped_tokens(manager, n)


def hybrid(role: str, **kw):
    sched = make_scheduler(role, BS, window=WINDOW, **kw)
    sched.connector.set_xfer_handshake_metadata({})
    if role == "kv_producer":
        sched.connector.scheduler.set_rank_metadata([rank_meta(block_size=BS)])
    return sched


def null_id(sched) -> int:
    return sched.kv_cache_manager.block_pool.null_block.block_id


def test_prefill_stages_the_sliding_groups_tail_and_the_full_groups_prompt():
    prefill = hybrid("kv_producer", extra={"lease_s": 60.0})
    try:
        prefill.add_request(make_request("p1", 100, {"do_remote_decode": True}))
        out, outputs = step(prefill)
        (save,) = meta(out).saves
        # The decode claims 99 tokens; it attends from 99 - 32 + 1 = 68, kept from block 4.
        assert save.starts == (64, 0)
        assert [len(ids) for ids in save.block_ids] == [7, 7]
        params = params_of(outputs, "p1")
        assert params is not None and tuple(params["group_starts"]) == (64, 0)
    finally:
        prefill.connector.shutdown()


@pytest.mark.parametrize("n", [95, 100, 111])
def test_decode_loads_from_its_first_kept_block_and_the_recomputed_token_sees_its_window(n):
    decode = hybrid("kv_consumer", engine_id="dec")
    try:
        params = remote_params(n)
        params["group_starts"] = list(
            staged_starts(decode.connector.scheduler.groups, n, BS, (0, 0))
        )
        req = make_request("d1", n, params, max_tokens=2)
        decode.add_request(req)
        out, _ = step(decode)
        (load,) = meta(out).loads
        assert load.error is None and load.end == tokens_to_load(
            n, decode.connector.scheduler.groups
        )
        sliding = load.block_ids[0]
        kept = next(i for i, b in enumerate(sliding) if b != null_id(decode))
        assert load.starts == (kept * BS, 0)  # nothing is loaded into vLLM's null block
        step(decode, KVConnectorOutput(finished_recving={"d1"}))
        step(decode)
        # The decode computes token n - 1 itself, attending from n - WINDOW: a real block.
        assert req.num_computed_tokens >= n
        assert sliding[(n - WINDOW) // BS] != null_id(decode)
    finally:
        decode.connector.shutdown()


def test_decode_refuses_a_ticket_that_staged_too_little_of_a_group():
    decode = hybrid("kv_consumer", engine_id="dec")
    try:
        params = remote_params(100)
        params["group_starts"] = [80, 0]  # the decode keeps the sliding group from token 64
        decode.add_request(make_request("d2", 100, params))
        out, _ = step(decode)
        (load,) = meta(out).loads
        assert load.error is not None and "KV cache group 0" in load.error
        one_group = remote_params(100) | {"group_starts": [64], "remote_request_id": "p2"}
        decode.add_request(make_request("d3", 100, one_group))
        out, _ = step(decode)
        (load,) = meta(out).loads
        assert load.error is not None and "stages 1 KV cache groups" in load.error
    finally:
        decode.connector.shutdown()


def test_staged_starts_never_go_before_what_the_prefill_still_holds():
    groups = (KVGroup(16, 32, ("a",)), KVGroup(16, 0, ("b",)))
    assert staged_starts(groups, 300, 128, (0, 0)) == (256, 0)
    assert staged_starts(groups, 300, 128, (260, 0)) == (260, 0)


def test_a_failed_load_is_reported_by_request_and_never_names_the_null_block():
    from testbed.worker_processes import make_worker
    from vllm_qaic_connector.step_metadata import LoadSpec, QAICConnectorMetadata

    args = dict(rank=0, tp=1, total_heads=2, block=BS, layout="vllm_cpu_vec", window=WINDOW)
    worker = make_worker({**args, "engine": f"hy{os.getpid()}", "extra": {}}, seed=1)
    try:
        sliding, full = [0, 0, 0, 0, 9, 8, 7], [1, 2, 3, 4, 5, 6, 7]  # 0: vLLM's null block
        spec = LoadSpec(
            request_id="d1", block_ids=(sliding, full), first_token=0, remote=None,
            error="bad", starts=(64, 0), claimed=99,
        )  # fmt: skip
        assert worker.loads.failed(spec, "bad").failed_blocks == {1, 2, 3, 4, 5, 6, 7, 8, 9}
        # Through the worker's step: block ids are per group, so vLLM is told by request id.
        worker.bind(QAICConnectorMetadata(loads=[spec]))
        worker.start_load_kv()
        deadline, done = time.monotonic() + 10, None
        while not done and time.monotonic() < deadline:
            _, done = worker.get_finished()
        assert done == {"d1"} and worker.take_failed_requests() == {"d1"}
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()
