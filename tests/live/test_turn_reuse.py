"""Multi-turn reuse, live (testbed/conversations.py): the short form of `make conversations`,
each day on a new seed that also picks the model (the shipped one, or a random Qwen3 whose
byte-level tokenizer turns an answer's text back into other tokens, so that only the whole
blocks before them load) and whether the prefill caches prefixes (vLLM's default: on).
Conversations over shm, with the faults; the make target runs every combination and NIXL."""

from __future__ import annotations

import random

import pytest

from testbed.conversations import print_reports, run
from testbed.live_servers import MODEL, random_model


def test_each_turn_equals_vllm_s_and_the_prefill_computes_only_what_is_new(
    tmp_path_factory, day_seed
):
    seed = day_seed
    byte_level, caching = random.Random(seed).choice([(False, True), (False, False), (True, False)])
    model = random_model(tmp_path_factory, "qwen3") if byte_level else MODEL
    shape = {"conversations": 4, "turns": 3} if byte_level else {"conversations": 8, "turns": 4}
    reports, _ = run("shm", caching, **shape, reuse=True, seed=seed, faults=True, model=model)
    print_reports(reports, f"seed {seed}, {model.name}, prefill prefix caching {caching}")
    assert all(not r.mismatches for r in reports), [r.mismatches for r in reports]
    later = reports[1:]
    assert all(r.within_bound for r in later), "a turn computed more than its new tokens"
    assert all(r.loaded > 0 for r in later), "no later turn loaded the decode's kept turn"
    assert all(r.kept_turns == len(reports[0].prefill_ms) for r in reports), [
        r.kept_turns for r in reports
    ]


@pytest.mark.daily  # one dtype a day, in turn: ALL_CASES=1 runs both
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_turns_under_kv_pressure_answer_as_vllm_alone(day_seed, dtype):
    """Both engines' KV caches hold a few requests (48 blocks of 32), 12 conversations at
    once beside long requests: the decode evicts kept turns (some in the step they were
    kept) and vLLM preempts, yet every turn and background answer equals vLLM alone's, and
    turns still load. A turn gone when its ticket is used is a failed load, recomputed."""
    reports, under = run("shm", True, conversations=12, turns=3, reuse=True, seed=day_seed,
                         pressure=48, dtype=dtype)  # fmt: skip
    print_reports(reports, f"seed {day_seed}, {dtype}, under pressure: {under}")
    assert under is not None and not under.background_mismatches, under
    assert all(not r.mismatches for r in reports), [r.mismatches for r in reports]
    assert under.evicted_turns > 0 and under.turn_loads > 0, under
