"""The handoff's share of TTFT (issue #71, point 3) in its short form, on real servers: a
scaled random model, a prefill that stages 128-token blocks into a 32-token decode's
format (converting on save), vLLM's own metrics for the save, the transfer and the load.
It must run through, write rows whose figures add up, and every answer must be the
reference's (the script exits 1 otherwise). Times are printed, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.handoff_share import QUICK_TOKENS
from testbed.quick_benchmarks import run_quick


def test_handoff_share_quick(tmp_path: Path) -> None:
    out, png = tmp_path / "share.json", tmp_path / "share.png"
    proc = run_quick("benchmarks.handoff_share", out, png, timeout_s=600)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["setup"], r["tokens"]) for r in rows] == [("shm-staged-32", n) for n in QUICK_TOKENS]
    shape = result["meta"]["shape"]
    per_token = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * 4  # float32
    for r in rows:
        assert r["bytes"] == r["tokens"] * per_token
        # A staged handoff copies on both sides: the save and the load took time.
        assert r["save_ms"] > 0 and r["load_ms"] > 0 and r["read_ms"] >= 0, r
        parts = r["save_ms"] + r["read_ms"] + r["copy_in_ms"]
        assert r["handoff_ms"] == pytest.approx(parts)
        assert r["share"] == pytest.approx(r["handoff_ms"] / r["ttft_ms"])
        assert r["us_per_token"] == pytest.approx(1e3 * r["handoff_ms"] / r["tokens"])
        assert r["gbps"] == pytest.approx(r["bytes"] / r["handoff_ms"] / 1e6)
        assert r["ratio_to_memcpy"] == pytest.approx(r["gbps"] / r["memcpy_gbps"])
        assert any(line.startswith(r["label"]) and f" {r['tokens']} " in line
                   for line in proc.stdout.splitlines())  # fmt: skip
    assert "handoffs that failed or answered other than vLLM alone: 0" in proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
