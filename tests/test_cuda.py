"""On a GPU (`pytest -m cuda`; skipped where torch sees no CUDA device): vLLM's own KV cache
views in device memory, moved byte-exactly between every pair of its layouts through the
real worker halves; a save that must wait for the forward still writing its blocks; the
throughput bench against a pinned copy of the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.rank_worker import LAYERS, make_worker
from tests.test_worker_ranks import VLLM_LAYOUTS, VLLM_PAIRS, full_heads, run_handoff
from vllm_qaic_connector import bench, request_saves
from vllm_qaic_connector.layout import gather_tokens
from vllm_qaic_connector.step_metadata import QAICConnectorMetadata, SaveSpec
from vllm_qaic_connector.tickets import HEADER_BYTES

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

CUDA_PAIRS = [p for p in VLLM_PAIRS if p[1] in VLLM_LAYOUTS]  # both caches on the GPU


@pytest.mark.parametrize("pair", CUDA_PAIRS, ids=lambda c: f"{c[0]}{c[3]}-to-{c[1]}{c[4]}-{c[2]}")
def test_vllm_layouts_on_the_gpu_move_byte_exactly(pair):
    src, dst, dtype, p_block, d_block = pair
    results, outs, _ = run_handoff(4, 1, 1, src, p_block, dst, d_block, 97, dtype=dtype,
                                   device="cuda")  # fmt: skip
    [out] = outs
    assert out["done"] == {"d1"} and out["errors"] == set()
    for layer in range(2):
        for kv in range(2):
            assert np.array_equal(out["got"][layer][kv], full_heads(results, 4, 1, layer, kv))


def test_a_save_waits_for_the_forward_still_writing_its_blocks(monkeypatch):
    """The forward's last kernel, on the engine's stream, is still writing the request's
    blocks when vLLM calls wait_for_save: the save thread must stage the new bytes."""
    monkeypatch.setattr(request_saves, "INLINE_SAVE_BYTES", 0)  # the save thread's path
    args = dict(rank=0, tp=1, total_heads=4, layout="LBNHC", block=16, engine="race",
                extra={"transport": "shm", "async_saves": True}, dtype="bfloat16",
                device="cuda")  # fmt: skip
    w = make_worker(args, 1)
    n, blocks = 200, list(range(13, 0, -1))
    spec = SaveSpec("r1", (blocks,), n, 4096, "LBNHC", 16, (5 << 32) + 1, (0,))
    engine = torch.cuda.Stream()
    with torch.cuda.stream(engine):
        torch.cuda._sleep(4_000_000_000)  # ~2 s of a busy forward
        for k, v in w.layers:
            k.fill_(3.0), v.fill_(-3.0)
        w.bind(QAICConnectorMetadata(saves=[spec]))
        w.wait_for_save()
        assert not engine.query(), "the writer finished before the save: no race to test"
    w.saves.saver.shutdown(wait=True)
    assert w.cache is not None and w.transport is not None
    fmt = w.cache.staging_format("LBNHC", w.cache.geometry, LAYERS, (0,))
    region = w.transport.staging[4096 + HEADER_BYTES :]
    for kv in fmt.layer_views(region, n):
        k, v = gather_tokens(kv, range(len(blocks)), n)
        assert bool((k.float() == 3.0).all()) and bool((v.float() == -3.0).all())
    w.shutdown()


def test_bench_on_the_gpu_moves_bytes_exactly_and_prints_ratios(capsys):
    assert bench.main(["--device", "cuda", "--tokens", "1024", "4096", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    print(out)  # the figures, in the run's log
    assert "summary: shm staged (HND 16)" in out and "summary: shm re-block+permute" in out
