import datetime
import os
from collections import defaultdict
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


# The day's seed: the live tests that draw (the differential's requests, the conversations'
# model, the ``daily`` cases below) draw anew each day; DAILY_SEED=YYYYMMDD repeats a day.
DAY_SEED = int(os.environ.get("DAILY_SEED") or datetime.date.today().strftime("%Y%m%d"))
DAY_NUMBER = datetime.datetime.strptime(str(DAY_SEED), "%Y%m%d").toordinal()


@pytest.fixture
def day_seed() -> int:
    return DAY_SEED


class DailyDraw:
    """A ``daily(n)`` test's cases are alternatives along one axis (a model family, a
    router): CI runs n of them a day, in turn, so that a run stays short and every case
    runs within len/n days. ``ALL_CASES=1`` runs every case; the summary names the cases a
    run left out."""

    def __init__(self) -> None:
        self.drawn: dict[str, tuple[list[str], list[str]]] = {}  # test: (run, not today)

    @pytest.hookimpl(trylast=True)  # after -k and -m: the draw is among the cases asked for
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]):
        if os.environ.get("ALL_CASES") == "1":
            return
        cases: dict[str, list[pytest.Item]] = defaultdict(list)
        for item in items:
            if item.get_closest_marker("daily"):
                cases[item.nodeid.split("[")[0]].append(item)
        left_out = []
        for test, drawable in cases.items():
            n = drawable[0].get_closest_marker("daily").kwargs.get("n", 1)
            turn = DAY_NUMBER * n
            drawn = [drawable[(turn + k) % len(drawable)] for k in range(min(n, len(drawable)))]
            dropped = [item for item in drawable if item not in drawn]
            self.drawn[test] = ([i.callspec.id for i in drawn], [i.callspec.id for i in dropped])
            left_out += dropped
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item not in left_out]

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.drawn:
            write = terminalreporter.write_line
            write(f"[daily] seed {DAY_SEED} (DAILY_SEED repeats a day, ALL_CASES=1 runs all):")
            for test, (drawn, dropped) in self.drawn.items():
                write(f"[daily]   {test}: ran {drawn}, not today {dropped}")


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
