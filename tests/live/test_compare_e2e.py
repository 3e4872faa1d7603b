"""The end-to-end comparison script (issue #13 item 3) in its short form, on real servers:
aggregated vLLM and this connector with 128 -> 32 blocks (vLLM's NixlConnector only in the
full run, `make compare`: CI time), closed loop, open loop and paired rounds. It must run
through, write one JSON row per setup and load, report the proxy's prefill leg and the
answering engine's own times (from its /metrics), and every answer of this connector must
be the aggregated server's (the script exits 1 otherwise). Times are printed, never
asserted."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from testbed.quick_benchmarks import run_quick


def test_compare_e2e_quick(tmp_path: Path) -> None:
    out, png = tmp_path / "rows.json", tmp_path / "ttft.png"
    proc = run_quick("benchmarks.compare_e2e", out, png, timeout_s=900)
    rows = {(r["setup"], r["concurrency"]): r for r in json.loads(out.read_text())}
    # Concurrency 4, then open loop (0) at the aggregated server's rate.
    assert set(rows) == {(s, c) for s in ("aggregated", "qaic-shm-128to32") for c in (4, 0)}
    for conc in (4, 0):
        ours, agg = rows["qaic-shm-128to32", conc], rows["aggregated", conc]
        assert ours["agreement"] == 1.0 and ours["correct"] == 1.0 and ours["errors"] == 0, ours
        assert agg["correct"] == 1.0, agg
        # The proxy's Server-Timing: a prefill leg inside the time to first token.
        assert 0 < ours["prefill_p50_ms"] <= ours["ttft_p95_ms"], ours
        # The answering engine's /metrics: the decode loaded through this connector.
        assert ours["kv_load_ms"] > 0 and ours["queued_ms"] >= 0 < ours["first_step_ms"], ours
        assert agg["queued_ms"] >= 0 < agg["first_step_ms"] and math.isnan(agg["kv_load_ms"])
    open_rates = {rows[s, 0]["arrivals_per_s"] for s in ("aggregated", "qaic-shm-128to32")}
    assert len(open_rates) == 1 and open_rates.pop() > 0, open_rates
    assert png.stat().st_size > 0
    assert "prefill throughput with the connector" in proc.stdout
    # Staged and plain prefills alternated on one server: a positive ratio per round.
    found = re.search(r"alternated: median ratio [0-9.]+ \(rounds ([0-9. ]+)\)", proc.stdout)
    assert found and [float(r) > 0 for r in found[1].split()] == [True] * 5, proc.stdout[-2000:]
    # Paired rounds on servers up at once: a ratio per round, every answer the aggregated one.
    paired = re.search(r"qaic-shm-128to32: median [0-9.]+ \(rounds ([0-9. ]+)\)", proc.stdout)
    assert paired and [float(r) > 0 for r in paired[1].split()] == [True] * 2, proc.stdout[-2000:]
    assert "differing from the aggregated server's, or failed: 0" in proc.stdout
    # The closed-loop floor that the prefill's rate puts under the TTFT, from this run.
    rest = rows["qaic-shm-128to32", 4]["rest_ms"]
    assert 0 < rest < math.inf and f"(after the first token {rest:.0f} ms)" in proc.stdout
