import os
from pathlib import Path

import pytest
import torch

from tests.daily_draw import DAY_SEED, DailyDraw

# The harness machines have 2 cores and other processes; OMP spin-waits across threads
# can stall vLLM's CPU ops, so tests use one intra-op thread.
torch.set_num_threads(1)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


LIVE = Path(__file__).resolve().parent / "live"


@pytest.fixture
def day_seed() -> int:
    """The day's seed (tests/daily_draw.py): the live tests that draw draw anew each day."""
    return DAY_SEED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(DailyDraw(), "daily-draw")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Markers by what a test needs (registered in pyproject.toml): every test under
    tests/live/ starts `vllm serve` (``live``); a test runs NIXL (``nixl``) where a fixture
    it uses is named for it (``nixl_cluster``) or a parameter picks it (``"nixl"``,
    ``"nixl-staged"``, ``{"KV_TRANSPORT": "nixl"}``); one that hard-codes NIXL marks itself,
    as do ``netns`` and ``cuda`` tests."""
    for item in items:
        if LIVE in item.path.parents:
            item.add_marker(pytest.mark.live)
        if _picks_nixl(item):
            item.add_marker(pytest.mark.nixl)


def _picks_nixl(item: pytest.Item) -> bool:
    if any("nixl" in name for name in getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    values = list(callspec.params.values()) if callspec else []
    while values:
        value = values.pop()
        if isinstance(value, str) and value.startswith("nixl"):
            return True
        if isinstance(value, dict):
            values += value.values()
        elif isinstance(value, tuple | list):
            values += value
    return False
