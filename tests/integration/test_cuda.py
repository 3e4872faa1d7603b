"""On a GPU (`pytest -m cuda`; skipped where torch sees no CUDA device): vLLM's own KV cache
views in device memory, moved byte-exactly between every pair of its layouts through the
real worker halves; a save that must wait for the forward still writing its blocks; the
throughput bench against a pinned copy of the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testbed import handoff_bench as bench
from testbed.worker_processes import (
    VLLM_LAYOUTS,
    VLLM_PAIRS,
    full_heads,
    make_worker,
    run_handoff,
)
from vllm_qaic_connector.kv.device_copies import DeviceCopies
from vllm_qaic_connector.kv.token_copies import gather_tokens
from vllm_qaic_connector.region_headers import HEADER_BYTES
from vllm_qaic_connector.step_metadata import QAICConnectorMetadata, SaveSpec
from vllm_qaic_connector.worker import request_saves

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


@pytest.mark.parametrize("waits", [True, False], ids=["saved", "control-without-the-wait"])
def test_a_save_waits_for_the_forward_still_writing_its_blocks(waits, monkeypatch):
    """The forward's last kernel, on the engine's stream, is still writing the request's
    blocks when vLLM calls wait_for_save: the save thread must stage the new bytes. The
    control drops the wait and must stage old ones (so the test can fail)."""
    monkeypatch.setattr(request_saves, "INLINE_SAVE_BYTES", 0)  # the save thread's path
    args = dict(rank=0, tp=1, total_heads=4, layout="LBNHC", block=16, engine="race",
                extra={"transport": "shm", "async_saves": True}, dtype="bfloat16",
                device="cuda")  # fmt: skip
    w = make_worker(args, 1)
    assert w.saves is not None and w.cache is not None and w.transport is not None
    n, blocks = 200, list(range(13, 0, -1))

    def save(request_id: str, offset: int) -> None:
        spec = SaveSpec(
            request_id=request_id, block_ids=(blocks,), num_tokens=n, staging_offset=offset,
            layout_kind="LBNHC", block_size=16, generation=(5 << 32) + 1,
        )  # fmt: skip
        w.bind(QAICConnectorMetadata(saves=[spec]))
        w.wait_for_save()

    # Every kernel of the race runs once first: CUDA loads a kernel on its first launch,
    # and a load waits for running kernels, which would order the save for us.
    save("warm-up", 1 << 20)
    assert w.saves._last_job is not None
    w.saves._last_job.result()
    for k, v in w.layers:
        k.fill_(0.0), v.fill_(0.0)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    if not waits:
        monkeypatch.setattr(DeviceCopies, "forward_done", staticmethod(lambda device: None))
    engine = torch.cuda.Stream()
    with torch.cuda.stream(engine):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy forward
        for k, v in w.layers:
            k.fill_(3.0), v.fill_(-3.0)
        save("r1", 4096)
        assert not engine.query(), "the writer finished before the save: no race to test"
    w.saves.saver.shutdown(wait=True)
    fmt = w.cache.staging_format("LBNHC", w.cache.geometry, (0,))
    region = w.transport.staging[4096 + HEADER_BYTES :]
    new = [
        bool((k.float() == 3.0).all()) and bool((v.float() == -3.0).all())
        for k, v in (gather_tokens(kv, range(len(blocks)), n) for kv in fmt.layer_views(region, n))
    ]
    w.shutdown()
    assert all(new) if waits else not any(new)


def test_bench_on_the_gpu_moves_bytes_exactly_and_prints_ratios(capsys):
    assert bench.main(["--device", "cuda", "--tokens", "1024", "4096", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    print(out)  # the figures, in the run's log
    assert "summary: shm staged (HND 16)" in out and "summary: shm re-block+permute" in out


# --- NIXL and GPU memory (needs nixl installed beside CUDA: see docs/gpu.md) ----------------
# (Reads between GPU and host memory: test_direct_reads.py, `-m cuda`.)


@pytest.mark.nixl
def test_a_gpu_rank_over_nixl_shares_its_cache_and_pins_its_staging():
    """With nixl_direct_reads a rank whose cache is on the GPU registers that cache (VRAM)
    and says so in its handshake; its staging and receive arena are page-locked for the
    device copies, and unregistered with CUDA when it closes."""
    import nixl  # noqa: F401  (NIXL missing is a failure, never a skip)

    extra = {"transport": "nixl", "staging_bytes": 1 << 20, "nixl_direct_reads": True}
    args = dict(rank=0, tp=1, total_heads=4, layout="LBHNC", block=16, engine="gpunixl",
                extra=extra, dtype="bfloat16", device="cuda")  # fmt: skip
    w = make_worker(args, 1)
    transport = w.transport
    assert w.rank_meta is not None and w.rank_meta.cache is not None
    assert w.rank_meta.cache.device == torch.cuda.current_device()
    staging = transport.staging
    assert any(t is staging for t in transport._pinned)
    w.shutdown()
    cudart = torch.cuda.cudart()  # unpinned: CUDA takes the range afresh
    assert int(cudart.cudaHostRegister(staging.data_ptr(), staging.numel(), 0)) == 0
    cudart.cudaHostUnregister(staging.data_ptr())
