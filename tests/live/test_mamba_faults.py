"""Load errors and leases on a model with recurrent state (issue #14 point 3), live.

A random GraniteMoeHybrid (Mamba2 + attention layers) on a prefill (core 0, short lease)
and a decode with ``kv_load_failure_policy`` "recompute" (core 1), in float32 and without
prefix caching (vLLM on CPU runs Mamba only so). A random model has no known answer: each
prompt's reference is the decode's own answer computed locally, without a handoff. A failed
load must make the decode recompute the Mamba state from nothing, never decode from a half
written or reused one: every answer must equal its reference. The run ends with no process
and no /dev/shm object left.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testbed.live_servers import (
    LiveRun,
    VllmServer,
    complete,
    copy_prompts,
    free_port,
    kv_config,
    random_model,
    stage,
    wait_all_ready,
)

LEASE_S = 2.0
MAX_TOKENS = 12
LOADED = "vllm:qaic_kv_loaded_requests_total"
LOAD_FAILURES = "vllm:qaic_kv_load_failures_total"
EXPIRIES = "vllm:qaic_kv_lease_expiries_total"
SERVE_ARGS = ["--no-enable-prefix-caching", "--dtype", "float32"]  # Mamba on vLLM's CPU


@dataclass
class MambaCluster:
    run: LiveRun
    prefill: VllmServer
    decode: VllmServer
    model: Path
    seed: int = 0

    def prompts(self, n: int) -> list[str]:
        self.seed += 1
        return [p for p, _ in copy_prompts(n, f"mamba-{self.seed}", tokens=150)]

    def local(self, prompt: str) -> str:
        """The reference: the decode's own answer, no handoff."""
        return text(*complete(self.decode.url, prompt, MAX_TOKENS))

    def handed_off(self, prompt: str, params: dict[str, Any]) -> str:
        return text(*complete(self.decode.url, prompt, MAX_TOKENS, kv_transfer_params=params))

    def count(self, server: VllmServer, name: str) -> float:
        return server.metric(name, 0.0)


def text(status: int, body: dict[str, Any]) -> str:
    assert status == 200, f"HTTP {status}: {str(body)[:400]}"
    return str(body["choices"][0]["text"])


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[MambaCluster]:
    model = random_model(tmp_path_factory, "granite_hybrid")
    run = LiveRun("mamba")
    failures0 = request.session.testsfailed
    try:

        def start(name: str, core: str, role: str, **extra: Any) -> VllmServer:
            kv = kv_config(role, run.engine_id(name[0]), free_port(), "shm", **extra)
            return run.vllm(name, core, kv, extra_args=SERVE_ARGS, model=model)

        prefill = start("prefill", "0", "kv_producer", lease_s=LEASE_S)
        decode = start("decode", "1", "kv_consumer", handshake_timeout_s=2.0)
        wait_all_ready(prefill, decode, retries=1)
        yield MambaCluster(run, prefill, decode, model)
    except BaseException:
        run.keep = True
        raise
    finally:
        run.keep |= request.session.testsfailed > failures0  # the server logs say why
        report = run.close()
        print(report.summary(), flush=True)
    assert report.clean, f"the Mamba run left things behind: {report.problems()}"


def test_a_handoff_equals_the_local_answer(cluster: MambaCluster) -> None:
    c = cluster
    prompts = c.prompts(3)
    loaded0 = c.count(c.decode, LOADED)
    for p in prompts:
        assert c.handed_off(p, stage(c.prefill.url, p)) == c.local(p)
    assert c.count(c.decode, LOADED) - loaded0 == len(prompts)


def test_b_a_dead_peer_costs_a_recompute_and_the_next_handoff_is_right(
    cluster: MambaCluster,
) -> None:
    """The decode allocated the request's state block for a load that fails: the
    recompute must not start from it, and the next request that gets it must be right."""
    c = cluster
    dead, good = c.prompts(2)
    failures0, loaded0 = c.count(c.decode, LOAD_FAILURES), c.count(c.decode, LOADED)
    params = {**stage(c.prefill.url, dead), "remote_port": free_port()}  # nobody listens
    assert c.handed_off(dead, params) == c.local(dead)
    assert c.handed_off(good, stage(c.prefill.url, good)) == c.local(good)
    assert c.count(c.decode, LOAD_FAILURES) - failures0 == 1
    assert c.count(c.decode, LOADED) - loaded0 == 1


def test_c_an_expired_lease_whose_pages_were_reused_is_refused(cluster: MambaCluster) -> None:
    """A's lease runs out and later prompts get its pages: A's ticket must not load their
    KV and state. It is refused by the ticket check, and A recomputes."""
    c = cluster
    a, *others = c.prompts(5)
    params_a = stage(c.prefill.url, a)
    time.sleep(LEASE_S + 1.0)
    reused, last = False, params_a
    for i, p in enumerate(others):  # a prefill expires leases after allocating: try a few
        last = stage(c.prefill.url, p)
        reused = reused or last.get("staging_offset") == params_a.get("staging_offset")
        if reused and i >= 1:
            break
    assert reused, "A's staged region was never reused: the case did not test what it should"
    assert c.handed_off(p, last) == c.local(p)  # the request that got the pages loads them
    failures0 = c.count(c.decode, LOAD_FAILURES)
    assert c.handed_off(a, params_a) == c.local(a)
    assert c.count(c.decode, LOAD_FAILURES) - failures0 == 1, "A's stale ticket was loaded"
    assert c.count(c.prefill, EXPIRIES) >= 1


def test_d_a_decode_that_zeroes_what_it_loads_answers_otherwise(cluster: MambaCluster) -> None:
    """The negative control of the cases above (and of the harness's Mamba case): a decode
    that zeroes the KV and the state it loads (``debug_corrupt_loaded_kv``) loads every
    handoff, and its answers part from the local ones. So a comparison with the local answer
    fails where the loaded state is wrong: the Mamba state is used, not recomputed."""
    c = cluster
    kv = kv_config("kv_consumer", c.run.engine_id("z"), free_port(), "shm",
                   debug_corrupt_loaded_kv=True)  # fmt: skip
    zeroing = c.run.vllm("zeroing", "1", kv, extra_args=SERVE_ARGS, model=c.model)
    wait_all_ready(zeroing, retries=1)
    prompts = c.prompts(4)
    answers = [
        text(*complete(zeroing.url, p, MAX_TOKENS, kv_transfer_params=stage(c.prefill.url, p)))
        for p in prompts
    ]
    same = sum(a == c.local(p) for a, p in zip(answers, prompts, strict=True))
    time.sleep(1.0)  # the last step's connector stats reach /metrics
    assert c.count(zeroing, LOADED) == len(prompts), "the zeroing decode did not load"
    assert same <= 1, f"{same} of {len(prompts)} answers from zeroed KV and state were right"
