"""The end-to-end comparison script (issue #13 item 3) in its short form, on real servers:
aggregated vLLM and this connector with 128 -> 32 blocks (vLLM's NixlConnector only in the
full run, `make compare`: CI time). It must run through, write one JSON row per setup, and
every answer of this connector must be the aggregated server's (the script exits 1
otherwise). Times are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_compare_e2e_quick(tmp_path: Path) -> None:
    out, png = tmp_path / "rows.json", tmp_path / "ttft.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare_e2e.py"), "--quick"]
    proc = subprocess.run(
        [*cmd, "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["setup"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"aggregated", "qaic-shm-128to32"}
    ours = rows["qaic-shm-128to32"]
    assert ours["agreement"] == 1.0 and ours["correct"] == 1.0 and ours["errors"] == 0, ours
    assert rows["aggregated"]["correct"] == 1.0, rows["aggregated"]
    assert png.stat().st_size > 0
    assert "prefill throughput with the connector" in proc.stdout
