"""Multi-turn reuse, live (testbed/conversations.py): the short form of `make conversations`
(8 conversations of 4 turns over shm with vLLM's defaults, a new seed each day; the make
target adds NIXL, prefill prefix caching off, and the same runs without reuse)."""

from __future__ import annotations

import datetime

from testbed.conversations import print_reports, run


def test_each_turn_equals_vllm_s_and_the_prefill_computes_only_what_is_new():
    seed = int(datetime.date.today().strftime("%Y%m%d"))
    reports = run("shm", True, conversations=8, turns=4, reuse=True, seed=seed, faults=True)
    print_reports(reports, f"seed {seed}")
    assert all(not r.mismatches for r in reports), [r.mismatches for r in reports]
    later = reports[1:]
    assert all(r.within_bound for r in later), "a turn computed more than its new tokens"
    assert all(r.loaded > 0 for r in later), "no later turn loaded the decode's kept turn"
    assert all(r.kept_turns == 8 for r in reports), [r.kept_turns for r in reports]
