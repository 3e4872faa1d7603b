"""The day's draw of live cases (a pytest plugin that tests/conftest.py registers)."""

import datetime
import os
from collections import defaultdict

import pytest

# The day's seed: the live tests that draw (the differential's requests, the conversations'
# model, the ``daily`` cases below) draw anew each day; DAILY_SEED=YYYYMMDD repeats a day.
DAY_SEED = int(os.environ.get("DAILY_SEED") or datetime.date.today().strftime("%Y%m%d"))
DAY_NUMBER = datetime.datetime.strptime(str(DAY_SEED), "%Y%m%d").toordinal()


class DailyDraw:
    """A ``daily(n)`` test's cases are alternatives along one axis (a model family, a
    router), as are the tests marked ``daily(axis=name)`` with one name: CI runs n of them
    a day, in turn, so that a run stays short and every case runs within len/n days.
    ``ALL_CASES=1`` runs every case; the summary names the cases a run left out."""

    def __init__(self) -> None:
        self.drawn: dict[str, tuple[list[str], list[str]]] = {}  # test: (run, not today)

    @pytest.hookimpl(trylast=True)  # after -k and -m: the draw is among the cases asked for
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]):
        if os.environ.get("ALL_CASES") == "1":
            return
        cases: dict[str, list[pytest.Item]] = defaultdict(list)
        for item in items:
            if marker := item.get_closest_marker("daily"):
                cases[marker.kwargs.get("axis") or item.nodeid.split("[")[0]].append(item)
        left_out = []
        for test, drawable in cases.items():
            n = drawable[0].get_closest_marker("daily").kwargs.get("n", 1)
            turn = DAY_NUMBER * n
            drawn = [drawable[(turn + k) % len(drawable)] for k in range(min(n, len(drawable)))]
            dropped = [item for item in drawable if item not in drawn]
            self.drawn[test] = ([_case(i) for i in drawn], [_case(i) for i in dropped])
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


def _case(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    return callspec.id if callspec else item.nodeid.split("::", 1)[1]
