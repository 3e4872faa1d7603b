"""CI-short soak (testbed/soak.py): 60 requests at concurrency 16 through 1P1D + proxy, with
hostile decode requests and client aborts, over NIXL; `make soak` runs the full one over
shm and NIXL. CI time: over shm the same mix runs in tests/live/test_faults.py::TestShm
(hostile params, aborts, a dead peer among good requests) and the harness's default case
(64 prompts at concurrency 16 under KV pressure)."""

from __future__ import annotations

import pytest

from testbed import soak


@pytest.mark.parametrize("transport", ["nixl"])
def test_short_soak(transport: str) -> None:
    rc = soak.main(["--requests", "60", "--concurrency", "16", "--transport", transport])
    assert rc == 0, "soak gates failed (see the [soak] lines above)"
