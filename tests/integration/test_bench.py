"""The benchmark CLI (`python -m testbed.handoff_bench`) in a tiny configuration: its rows
add up, a wrong byte on any path fails the run, and no shm segment outlives it."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from testbed import handoff_bench as bench
from testbed.shipped_model import ROOT
from testbed.shm_objects import segments
from vllm_qaic_connector.kv import copy_pool
from vllm_qaic_connector.layout import LAYOUTS, KVGeometry, get_layout
from vllm_qaic_connector.worker import direct_reads

LAYERS, HEADS, HEAD_DIM = 2, 2, 16
TINY = ["--layers", str(LAYERS), "--kv-heads", str(HEADS), "--head-dim", str(HEAD_DIM)]
KEYS = list(bench.PATHS)  # NIXL's too: NIXL missing is a failure, never a skip
LABELS = [bench.PATHS[k].label for k in KEYS]


def start(*args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "testbed.handoff_bench", *TINY, *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def leftovers(pid: int) -> list[str]:
    return sorted(segments(f"qaic_kv_bench{pid}"))


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert leftovers(proc.pid) == []
    assert "leaked" not in err  # the resource tracker would hide a leak, with this warning
    return proc.returncode, out, err


def test_rows_add_up_and_nothing_is_left_behind(tmp_path: Path) -> None:
    rows_file, png = tmp_path / "rows.json", tmp_path / "rows.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    rc, out, err = finish(
        start("--tokens", "40", "300", "--repeats", "1", "--json", str(rows_file), *plot)
    )
    assert rc == 0, err
    rows = json.loads(rows_file.read_text())
    assert [(r["path"], r["tokens"]) for r in rows] == [(lb, n) for n in (40, 300) for lb in LABELS]
    for r in rows:
        assert {"path", "tokens", "bytes", "seconds", "gbps", "ratio_to_memcpy"} <= r.keys()
        # K and V, per layer, head and head_dim element, of fp16: partial blocks count no more.
        assert r["bytes"] == r["tokens"] * 2 * LAYERS * HEADS * HEAD_DIM * 2
        assert r["seconds"] > 0 and r["memcpy_gbps"] > 0
        assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["ratio_to_memcpy"] == pytest.approx(r["gbps"] / r["memcpy_gbps"])
        assert any(
            line.startswith(r["path"]) and f" {r['tokens']} " in line for line in out.splitlines()
        )
    for label in LABELS:
        assert f"summary: {label}: " in out and "at 300 tokens" in out
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_flipped_bit_on_any_path_fails_the_run() -> None:
    rc, out, err = finish(start("--tokens", "40", "--repeats", "1", "--corrupt"))
    assert rc == 1
    for label in LABELS:
        assert f"MISMATCH {label} at 40 tokens: 1 of {2 * LAYERS} planes differ" in err
    assert "summary" not in out


@pytest.mark.parametrize("key", KEYS)
def test_a_copy_that_drops_the_last_token_is_caught(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def one_token_short(real):
        def short(src, src_blocks, dst, dst_blocks, t0, t1, *rest):
            return real(src, src_blocks, dst, dst_blocks, t0, t1 - 1, *rest)

        return short

    def short_ranges(src, dst, runs, itemsize):  # direct: no last block
        s0, d0, n = runs[-1]
        runs = [*runs[:-1], *([(s0, d0, n - 1)] if n > 1 else [])]
        return real_ranges(src, dst, runs, itemsize)

    real_ranges = direct_reads.block_ranges
    # staged saves and loads, and direct copies between formats
    monkeypatch.setattr(copy_pool, "copy_layers", one_token_short(copy_pool.copy_layers))
    monkeypatch.setattr(direct_reads, "block_ranges", short_ranges)
    shape = bench.Shape(LAYERS, HEADS, HEAD_DIM, torch.float16)
    with pytest.raises(bench.Mismatch, match=f"{2 * LAYERS} of {2 * LAYERS} planes differ"):
        bench.measure(bench.PATHS[key], shape, 70, 1, corrupt=False)
    assert leftovers(os.getpid()) == []


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_the_check_compares_bytes_not_values(kind: str) -> None:
    """Random bytes hold NaNs, equal to themselves only as bytes; one flipped bit is found."""
    geo = KVGeometry(HEADS, HEAD_DIM, 16, torch.float16)
    layer = get_layout(kind).allocate(5, geo)
    memory = layer.as_strided((layer.numel(),), (1,))  # in memory order, whatever the view's
    memory.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, (layer.numel(),)))
    memory[7] = float("nan")
    cache = ([get_layout(kind).kv_views(layer, geo)], [3, 0, 4, 1])
    assert bench.mismatches(cache, cache, 50) == []
    other = layer.clone()
    other.as_strided((other.numel(),), (1,)).view(torch.int16)[-1] ^= 1  # block 4: tokens 32..47
    assert bench.mismatches(cache, ([get_layout(kind).kv_views(other, geo)], cache[1]), 50)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_frees_every_segment(signum: int) -> None:
    # Rows of 30k tokens: each holds its segments for tens of ms (at 3k, a few ms, which
    # the polling below could miss from the first row to the last on a fast host).
    proc = start("--tokens", *["30000"] * 40, "--paths", "shm", "slot-write", "--repeats", "1")
    try:
        assert proc.stdout is not None
        while not proc.stdout.readline().startswith("shm direct"):  # a row: imports are done
            assert proc.poll() is None
        deadline = time.monotonic() + 30
        while not leftovers(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert leftovers(proc.pid), "no segment seen while the bench runs"
        proc.send_signal(signum)
        rc, _, err = finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 128 + signum and "interrupted" in err


def test_on_a_gpu_a_cache_is_read_directly_over_nixl_only() -> None:
    """With --device cuda every staged path runs, and of the direct ones only NIXL's: a GPU
    cache is never moved into shm, while NIXL registers it as VRAM."""
    paths = bench.parse(["--device", "cuda", "--paths", *bench.PATHS]).paths
    direct = {k for k in paths if bench.PATHS[k].direct}
    assert direct == {"nixl"}
    assert set(paths) - direct == {k for k, p in bench.PATHS.items() if not p.direct}
