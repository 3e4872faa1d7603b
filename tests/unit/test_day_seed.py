"""The day's seed (tests/day_seed.py), on a generated test file run by pytest itself: the
seed reaches the tests and the summary names it, and no case is left out whatever the day
(the draw of one case per axis a day is gone: every case runs on every run)."""

from __future__ import annotations

import re

import pytest

pytest_plugins = ["pytester"]

CASES = """
import pytest

@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_model(family, day_seed):
    print(f"seed={day_seed}")

def test_prefill_restart():
    pass

def test_decode_restart():
    pass
"""


def ran(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, day: str):
    monkeypatch.setenv("DAILY_SEED", day)
    pytester.makeconftest(
        "import pytest\n"
        "from tests.day_seed import DAY_SEED, DaySeed\n"
        "@pytest.fixture\n"
        "def day_seed():\n"
        "    return DAY_SEED\n"
        "def pytest_configure(config):\n"
        "    config.pluginmanager.register(DaySeed(), 'day-seed')\n"
    )
    pytester.makepyfile(test_cases=CASES)
    result = pytester.runpytest_subprocess("-v", "-s")
    return set(re.findall(r"::(test_\w+(?:\[\w+\])?)", result.stdout.str())), result


def test_every_case_runs_every_day_on_that_day_s_seed(pytester, monkeypatch, request):
    monkeypatch.setenv("PYTHONPATH", str(request.config.rootpath))
    for day in ("20261129", "20261130"):
        passed, result = ran(pytester, monkeypatch, day)
        result.assert_outcomes(passed=5)
        assert len(passed) == 5, passed
        result.stdout.fnmatch_lines([f"*seed={day}*", f"*[[]day[]] seed {day}*"])
        assert "deselected" not in result.stdout.str()
