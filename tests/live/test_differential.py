"""The proxy against vLLM itself over generated requests (testbed/differential.py): the
short form of `make differential` (2 x 20 requests: CI time; the second fleet drafts n-gram
speculative tokens), a new seed each day
(printed: a difference found is found again with ``python -m testbed.differential --seed S``)."""

from __future__ import annotations

from testbed.differential import run_differential


def test_the_proxy_answers_as_vllm_over_generated_requests(day_seed):
    seed = day_seed
    print(f"[differential] seed {seed}", flush=True)
    differences = run_differential(20, seed, lambda line: print(line, flush=True))
    assert not differences, f"{len(differences)} answers differ from vLLM's (seed {seed})"
