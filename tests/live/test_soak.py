"""CI-short soak (tests/soak.py): 60 requests at concurrency 16 through 1P1D + proxy, with
hostile decode requests and client aborts; the full one is `make soak`."""

from __future__ import annotations

import pytest

from testbed import soak


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_short_soak(transport: str) -> None:
    rc = soak.main(["--requests", "60", "--concurrency", "16", "--transport", transport])
    assert rc == 0, "soak gates failed (see the [soak] lines above)"
