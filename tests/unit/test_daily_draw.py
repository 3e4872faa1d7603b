"""The day's draw of live cases (tests/daily_draw.py), on a generated test file run by
pytest itself: each day runs n cases of an axis, every case runs within len/n days, and
ALL_CASES=1 runs them all."""

from __future__ import annotations

import re

import pytest

pytest_plugins = ["pytester"]

CASES = """
import pytest

@pytest.mark.daily
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_model(family):
    pass

@pytest.mark.daily(axis="restart")
def test_prefill_restart():
    pass

@pytest.mark.daily(axis="restart")
def test_decode_restart():
    pass

def test_always():
    pass
"""


def ran(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, day: str, *args: str):
    monkeypatch.setenv("DAILY_SEED", day)
    pytester.makeconftest(
        "from tests.daily_draw import DailyDraw\n"
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'daily')\n"
        "    config.pluginmanager.register(DailyDraw(), 'daily-draw')\n"
    )
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest_subprocess("-v", *args)
    return set(re.findall(r"::(test_\w+(?:\[\w+\])?) PASSED", result.stdout.str())), result


@pytest.fixture
def repo_on_path(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    monkeypatch.setenv("PYTHONPATH", str(request.config.rootpath))
    monkeypatch.delenv("ALL_CASES", raising=False)


@pytest.mark.usefixtures("repo_on_path")
def test_each_day_runs_one_case_of_each_axis_and_three_days_run_them_all(pytester, monkeypatch):
    seen: set[str] = set()
    for day in ("20261129", "20261130", "20261201"):
        passed, result = ran(pytester, monkeypatch, day)
        models = {t for t in passed if t.startswith("test_model")}
        restarts = {t for t in passed if "restart" in t}
        assert len(models) == 1 and len(restarts) == 1 and "test_always" in passed, passed
        result.stdout.fnmatch_lines([f"*[[]daily[]] seed {day}*", "*restart: ran*not today*"])
        seen |= passed
    assert {f"test_model[{f}]" for f in ("llama", "qwen3", "gemma3")} <= seen
    assert {"test_prefill_restart", "test_decode_restart"} <= seen


@pytest.mark.usefixtures("repo_on_path")
def test_all_cases_runs_every_case_and_a_named_case_runs_whatever_the_day(pytester, monkeypatch):
    monkeypatch.setenv("ALL_CASES", "1")
    passed, _ = ran(pytester, monkeypatch, "20261129")
    assert len(passed) == 6, passed
    monkeypatch.delenv("ALL_CASES")
    for day in ("20261129", "20261130", "20261201"):
        passed, _ = ran(pytester, monkeypatch, day, "-k", "qwen3")
        assert passed == {"test_model[qwen3]"}, (day, passed)
