import os
from pathlib import Path

import pytest
import torch

# The harness machines have 2 cores and other processes; OMP spin-waits across threads
# can stall vLLM's CPU ops, so tests use one intra-op thread.
torch.set_num_threads(1)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


LIVE = Path(__file__).resolve().parent / "live"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Markers by what a test needs (registered in pyproject.toml): every test under
    tests/live/ starts `vllm serve` (``live``); a test whose id (file, class, name or
    parameters) says "nixl" runs NIXL (``nixl``). ``netns`` and ``cuda`` are set by the
    tests themselves."""
    for item in items:
        if LIVE in item.path.parents:
            item.add_marker(pytest.mark.live)
        if "nixl" in item.nodeid.lower():
            item.add_marker(pytest.mark.nixl)
