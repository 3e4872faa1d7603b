"""A benchmark's short form as a live test runs it: its module under ``python -m`` with
``--quick``, writing its JSON and its plot into a test's folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from testbed.shipped_model import ROOT


def run_quick(
    module: str, json_out: Path, plot_out: Path, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Runs it to the end (the process's output printed, for the test's log); it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--json", str(json_out), "--plot", str(plot_out)],
        capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
    )  # fmt: skip
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc
