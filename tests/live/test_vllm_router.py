"""The connector behind vLLM's own P/D router (the Rust `vllm-router`, installed with the test
extras), unchanged: live `vllm serve` pairs, the real router binary in front, real clients.

Every engine is ``kv_both``, as NixlConnector's P/D examples configure them: the role a
request plays comes from its ``kv_transfer_params``. The router speaks NixlConnector's
protocol: it names no decode, re-serialises the JSON (floats come back perturbed: tickets
must not care), and splices nothing in. So: answers
right through completions and chat, streamed and not; every request loaded from the
prefill's KV, none failed; a prefill told its decodes (`decode_peers`) hands off in their
format (over shm on one host they read its cache directly), one not told stages in its own;
and staging freed by the decodes' acknowledgements, after the run and after a client abort,
never by a lease running out, with no request to make an idle prefill step: its gauge
falls when the decode frees the pages.
The fleet is 2P2D with a side-channel key (the prefills' from the environment, the decodes'
from a file); one prefill and one decode run the connector inside vLLM's MultiConnector
(how operators add cache tiers), so its metadata, handshake and stats go through that."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from testbed import proxy_clients
from testbed.live_servers import (
    ANSWER_TOKENS,
    PY,
    LiveRun,
    Server,
    VllmServer,
    copy_prompts,
    free_port,
    kv_config,
    multi_connector,
    poll_until,
    wait_all_ready,
)
from vllm_qaic_connector.protocol.keys import KEY_ENV

ROUTER = Path(PY).parent / "vllm-router"
LOADED = "vllm:qaic_kv_loaded_requests_total"
LOAD_FAILURES = "vllm:qaic_kv_load_failures_total"
DIRECT = "vllm:qaic_kv_direct_reads_total"
PAGES_IN_USE = "vllm:qaic_kv_staging_pages_in_use"
EXPIRIES = "vllm:qaic_kv_lease_expiries_total"
SAVED = "vllm:qaic_kv_saved_requests_total"
LEASE_S = 4.0


class Fleet:
    def __init__(self, run: LiveRun, prefills: list[VllmServer], decodes: list[VllmServer],
                 router: Server) -> None:  # fmt: skip
        self.run, self.prefills, self.decodes, self.router = run, prefills, decodes, router

    def total(self, servers: list[VllmServer], name: str) -> float:
        return sum(s.metric(name, 0.0) for s in servers)

    def staging_freed(self) -> bool:
        """Every prefill's staging gauge at zero, as an operator sees it: nothing sent to
        the prefills to make them step."""
        return self.total(self.prefills, PAGES_IN_USE) == 0


def start_fleet(transport: str, keyed: bool, n: int) -> Fleet:
    router_bin = str(ROUTER) if ROUTER.exists() else shutil.which("vllm-router")
    assert router_bin, "vllm-router is not installed: make setup (the test extras) brings it"
    run = LiveRun(f"router{transport}")
    try:
        key_env: dict[str, str] = {}
        decode_extra: dict[str, Any] = {}
        if keyed:  # the prefills' key from the environment, the decodes' from a file
            key_file = run.key_file()
            key_env = {KEY_ENV: Path(key_file).read_text()}
            decode_extra["side_channel_key_file"] = key_file
        chat = ["--chat-template", proxy_clients.CHAT_TEMPLATE]
        # One engine_id per kind, as replicas of one Deployment share their config: peers
        # are told apart by address and incarnation, never by engine_id.
        decode_kvs = [
            kv_config("kv_both", run.engine_id("d"), free_port(), transport, **decode_extra)
            for i in range(n)
        ]  # fmt: skip
        peers = [f"127.0.0.1:{kv['kv_connector_extra_config']['side_channel_port']}"
                 for kv in decode_kvs]  # fmt: skip
        # The second engine of each kind runs the connector inside vLLM's MultiConnector.
        wrap = [lambda kv: kv, multi_connector]
        decodes = [run.vllm(f"decode{i}", "1", wrap[i](kv), extra_args=chat)
                   for i, kv in enumerate(decode_kvs)]  # fmt: skip
        # The first prefill knows its decodes (`decode_peers`); the others stage blind.
        prefills = [
            run.vllm(f"prefill{i}", "0", wrap[i](kv_config(
                "kv_both", run.engine_id("p"), free_port(), transport,
                lease_s=LEASE_S, **({"decode_peers": peers} if i == 0 else {}),
            )), extra_args=chat, extra_env=key_env)
            for i in range(n)
        ]  # fmt: skip
        wait_all_ready(*prefills, *decodes, retries=1)
        port = free_port()
        argv = [router_bin,
                "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
                "--policy", "round_robin"]  # fmt: skip
        for p in prefills:
            argv += ["--prefill", p.url]
        for d in decodes:
            argv += ["--decode", d.url]
        router = Server("vllm-router", argv, dict(os.environ), run.dir, port)
        run.servers.append(router)
        router.start()
        router.wait_ready(60)
        return Fleet(run, prefills, decodes, router)
    except BaseException:
        run.keep = True
        print(run.close().summary())
        raise


# One fleet (CI time): NIXL behind the router runs in the harness's random Llama case.
@pytest.fixture(params=[("shm", True, 2)], ids=["shm-2P2D-keyed"])
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    transport, keyed, n = request.param
    fleet = start_fleet(transport, keyed, n)
    failed = request.session.testsfailed
    yield fleet
    fleet.run.keep |= request.session.testsfailed > failed
    report = fleet.run.close()
    print(report.summary(), flush=True)
    assert report.clean, f"the run left things behind: {report.problems()}"


def test_the_connector_works_unchanged_behind_vllm_router(fleet: Fleet) -> None:
    f = fleet
    client = openai.OpenAI(base_url=f"{f.router.url}/v1", api_key="unused", max_retries=0)
    shm = f.prefills[0].kv is not None and f.prefills[0].kv["kv_connector_extra_config"][
        "transport"] == "shm"  # fmt: skip

    def warm() -> bool:
        """Until the first prefill has met its decodes (`decode_peers`, handshaken as both
        start): over shm the decodes then read its cache directly."""
        direct0 = f.total(f.decodes, DIRECT)
        for prompt, _ in copy_prompts(len(f.prefills), f"warm-{time.monotonic()}"):
            client.completions.create(model="model", prompt=prompt, max_tokens=2)
        time.sleep(1.0)
        return not shm or f.total(f.decodes, DIRECT) - direct0 >= 1

    assert poll_until(warm, 60, 0.5)[0], "the prefills never staged in their decodes' format"
    before = {n: f.total(f.decodes, n) for n in (LOADED, LOAD_FAILURES, DIRECT)}
    told0 = f.prefills[0].metric(SAVED, 0.0)  # handoffs of the prefill told its decodes
    expired0 = f.total(f.prefills, EXPIRIES)
    prompts = copy_prompts(4, f"router-{f.router.port}")
    sent, wrong = 0, []
    for prompt, answer in prompts:
        got = client.completions.create(model="model", prompt=prompt, max_tokens=ANSWER_TOKENS,
                                        temperature=0.0).choices[0].text  # fmt: skip
        stream = client.completions.create(model="model", prompt=prompt, max_tokens=ANSWER_TOKENS,
                                           temperature=0.0, stream=True)  # fmt: skip
        streamed = "".join(c.text for chunk in stream for c in chunk.choices)
        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(
            model="model", messages=messages, max_completion_tokens=ANSWER_TOKENS,  # type: ignore[arg-type]
            temperature=0.0,
        )  # fmt: skip
        chat_stream = client.chat.completions.create(
            model="model", messages=messages, max_completion_tokens=ANSWER_TOKENS,  # type: ignore[arg-type]
            temperature=0.0, stream=True,
        )  # fmt: skip
        chat_streamed = "".join(c.choices[0].delta.content or "" for c in chat_stream
                                if c.choices)  # fmt: skip
        texts = [got, streamed, chat.choices[0].message.content or "", chat_streamed]
        wrong += [(prompt[:40], t) for t in texts if t.strip() != answer]
        sent += 4
    time.sleep(1.0)  # the last step's connector stats reach /metrics
    loaded, failed, direct = (f.total(f.decodes, n) - before[n] for n in before)
    told = f.prefills[0].metric(SAVED, 0.0) - told0
    freed, _ = poll_until(f.staging_freed, 15)
    expired = f.total(f.prefills, EXPIRIES) - expired0
    print(f"[router] sent={sent} wrong={len(wrong)} loaded={loaded} load_failures={failed} "
          f"direct={direct} of_told_prefill={told} staging_freed={freed} expired={expired}",
          flush=True)  # fmt: skip
    assert not wrong, wrong[:4]
    assert (loaded, failed) == (sent, 0)
    if shm:
        assert 0 < direct == told < loaded, "direct reads: exactly the told prefill's"
    assert freed and expired == 0, "staging freed by the acknowledgements, not by leases"

    # A client that disconnects after the first streamed chunk of a long answer.
    body = {"model": "model", "prompt": prompts[0][0], "max_tokens": 700, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with requests.post(f"{f.router.url}/v1/completions", json=body, stream=True,
                       timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.text
        next(r.iter_content(chunk_size=None))
    freed, _ = poll_until(f.staging_freed, 30)
    assert freed and f.total(f.prefills, EXPIRIES) == expired0
    assert f.total(f.decodes, LOAD_FAILURES) == before[LOAD_FAILURES]
