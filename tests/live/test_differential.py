"""The proxy against vLLM itself over generated requests (testbed/differential.py): the
short form of `make differential`, a new seed each day, one fleet a day in turn (the day's
draw; 30 requests: CI time, spent mostly starting a fleet's engines): vLLM's defaults, or a
generation-config cap without prefix caching, drafting n-gram speculative tokens and keeping
turns. Printed: a difference found is found again with
``python -m testbed.differential --seed S --fleet F``."""

from __future__ import annotations

import pytest

from testbed.differential import FLEETS, run_differential


@pytest.mark.daily  # one fleet a day, in turn: ALL_CASES=1 runs both
@pytest.mark.parametrize("fleet", FLEETS)
def test_the_proxy_answers_as_vllm_over_generated_requests(day_seed, fleet):
    seed = day_seed
    print(f"[differential] seed {seed}, fleet {fleet}", flush=True)
    differences = run_differential(30, seed, lambda line: print(line, flush=True), only=fleet)
    assert not differences, f"{len(differences)} answers differ from vLLM's (seed {seed} {fleet})"
