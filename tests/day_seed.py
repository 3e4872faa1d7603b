"""The day's seed (a pytest plugin that tests/conftest.py registers): the live tests that
draw request content (the differential's requests, the conversations' prompts) draw anew
each day. Every case runs on every run: the seed picks content, never which cases run."""

import datetime
import os

import pytest

# DAILY_SEED=YYYYMMDD repeats a day's content.
DAY_SEED = int(os.environ.get("DAILY_SEED") or datetime.date.today().strftime("%Y%m%d"))


class DaySeed:
    """Names the seed at the end of a run, so that a failure drawn today can be repeated."""

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.write_line(f"[day] seed {DAY_SEED} (DAILY_SEED={DAY_SEED} repeats it)")
