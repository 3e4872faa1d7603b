"""The proxy against vLLM itself over generated requests (testbed/differential.py): the
short form of `make differential`, a new seed each day, one fleet a day in turn (the day's
draw; 30 requests, two conversations at once: CI time, spent mostly starting a fleet's
engines): vLLM's defaults, or a generation-config cap without prefix caching, drafting
n-gram speculative tokens and keeping turns. It fails on an answer unlike vLLM's, a ticket
shown to a client, a handoff that did not load (or failed) and an engine left busy.
Printed: a difference found is found again with
``python -m testbed.differential --seed S --fleet F --concurrency 2``."""

from __future__ import annotations

import pytest

from testbed.differential import FLEETS, run_differential


@pytest.mark.daily  # one fleet a day, in turn: ALL_CASES=1 runs both
@pytest.mark.parametrize("fleet", FLEETS)
def test_the_proxy_answers_as_vllm_over_generated_requests(day_seed, fleet):
    seed = day_seed
    print(f"[differential] seed {seed}, fleet {fleet}", flush=True)
    say = lambda line: print(line, flush=True)  # noqa: E731
    found = run_differential(30, seed, say, only=fleet, concurrency=2)
    assert not found, f"{len(found)} things found (seed {seed} {fleet}): see the lines above"
