"""The scheduler half inside a real vLLM Scheduler, with real Request objects."""

from __future__ import annotations

import time

import msgspec
import pytest
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from testbed.handshake_ranks import rank_meta
from testbed.llm_d_sidecar import ROUTER_PARAMS
from testbed.ports import free_port
from testbed.vllm_harness import (
    BS,
    free_blocks,
    make_request,
    make_scheduler,
    meta,
    params_of,
    remote_params,
    step,
)
from vllm_qaic_connector.config import parse_config
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.keys import KEY_ENV
from vllm_qaic_connector.protocol.routed_params import RoutedParams
from vllm_qaic_connector.protocol.ticket import prompt_hash
from vllm_qaic_connector.protocol.wire import ReleaseRequest
from vllm_qaic_connector.region_headers import HEADER_BYTES


@pytest.fixture
def prefill():
    sched = make_scheduler("kv_producer", BS, {"lease_s": 60.0})
    sched.connector.set_xfer_handshake_metadata({})
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    yield sched
    sched.connector.shutdown()


# The asynchronous load (over NIXL, with several KV cache groups, or sync_loads off): the
# request waits for the worker's report. Over shm loads run in the step (`test_in_step_*`).
ASYNC = {"sync_loads": False}


@pytest.fixture
def decode():
    sched = make_scheduler("kv_consumer", BS, ASYNC, engine_id="dec")
    yield sched
    sched.connector.shutdown()


@pytest.mark.parametrize("async_saves", [False, True])
def test_prefill_stages_whole_prompt_and_returns_params(async_saves):
    prefill = make_scheduler("kv_producer", BS, {"lease_s": 60.0, "async_saves": async_saves})
    prefill.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        check_prefill_stages_whole_prompt(prefill, async_saves)
    finally:
        prefill.connector.shutdown()


def check_prefill_stages_whole_prompt(prefill, async_saves: bool) -> None:
    pool = prefill.connector.scheduler.pool
    free_before = free_blocks(prefill)
    req = make_request("p1", 45, {"do_remote_decode": True})
    prefill.add_request(req)
    out, outputs = step(prefill)
    saves = meta(out).saves
    assert [s.request_id for s in saves] == ["p1"]
    assert saves[0].num_tokens == 45 and len(saves[0].block_ids[0]) == 3
    params = params_of(outputs, "p1")
    assert params["do_remote_prefill"] is True
    assert params["num_tokens"] == 45 and params["remote_request_id"] == "p1"
    assert params["staging_offset"] == saves[0].staging_offset
    if async_saves:
        # The save runs after the step, on the worker's thread: vLLM holds the blocks
        # until the worker says the save is done, and the worker learns which requests
        # to report from the next step's metadata.
        assert free_blocks(prefill) < free_before
        out, _ = step(prefill)
        assert meta(out).await_saves == ["p1"] and meta(out).saves == []
        assert free_blocks(prefill) < free_before
        step(prefill, KVConnectorOutput(finished_sending={"p1"}))
    else:
        out, _ = step(prefill)
        assert meta(out).await_saves == []
    assert free_blocks(prefill) == free_before
    assert pool.has("p1")  # the staging lease outlives the blocks
    # The decode releases it over the real side channel.
    side_channel.call(
        params["remote_host"], params["remote_port"], ReleaseRequest(["p1"]), None, 5.0
    )
    assert not pool.has("p1") and pool.pages_in_use == 0


def test_chunked_prefill_stages_each_chunk_and_seals_with_the_last():
    sched = make_scheduler("kv_producer", BS, max_batched=32)
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        sched.add_request(make_request("c1", 70, {"do_remote_decode": True}))
        saves_per_step = []
        for _ in range(3):
            out, _ = step(sched)
            saves_per_step.append(meta(out).saves)
        assert [len(s) for s in saves_per_step] == [1, 1, 1]
        parts = [s[0] for s in saves_per_step]
        # Chunks of 32 tokens, each staged as it is computed; only the last seals.
        assert [(p.first, p.last) for p in parts] == [(0, 32), (32, 64), (64, 70)]
        assert [bool(p.generation) for p in parts] == [False, False, True]
        assert len({p.staging_offset for p in parts}) == 1
        assert parts[2].num_tokens == 70 and len(parts[2].block_ids[0]) == 5
    finally:
        sched.connector.shutdown()


def test_a_prompt_aborted_after_its_first_chunk_holds_its_blocks_for_that_save():
    sched = make_scheduler("kv_producer", BS, {"async_saves": True}, max_batched=32)
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        free_before = free_blocks(sched)
        sched.add_request(make_request("c1", 70, {"do_remote_decode": True}))
        out, _ = step(sched)
        assert [s.generation for s in meta(out).saves] == [0]  # a chunk, on the save thread
        sched.finish_requests("c1", RequestStatus.FINISHED_ABORTED)
        assert sched.connector.scheduler.pool.pages_in_use == 0  # nobody will read it
        out, _ = step(sched)
        assert meta(out).await_saves == ["c1"] and free_blocks(sched) < free_before
        step(sched, KVConnectorOutput(finished_sending={"c1"}))
        assert free_blocks(sched) == free_before
    finally:
        sched.connector.shutdown()


def test_prefill_abort_before_save_leaks_nothing(prefill):
    free_before = free_blocks(prefill)
    prefill.add_request(make_request("a1", 40, {"do_remote_decode": True}))
    prefill.finish_requests("a1", RequestStatus.FINISHED_ABORTED)
    out, _ = step(prefill)
    assert meta(out).saves == []
    assert free_blocks(prefill) == free_before
    assert prefill.connector.scheduler.pool.pages_in_use == 0


def test_lease_expires_without_release():
    sched = make_scheduler("kv_producer", BS, {"lease_s": 0.01})
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        sched.add_request(make_request("l1", 20, {"do_remote_decode": True}))
        step(sched)
        pool = sched.connector.scheduler.pool
        assert pool.has("l1")
        time.sleep(0.05)
        step(sched)  # any step expires old leases
        assert not pool.has("l1")
    finally:
        sched.connector.shutdown()


def test_a_ticket_s_lease_runs_from_its_hand_out_not_from_a_long_step(monkeypatch):
    """A step that outlasts the lease between staging and the ticket's hand-out (vLLM
    compiles its logprob kernel in a server's first logprobs request: 11 s on CPU) still
    hands the decode a ticket with the whole lease ahead. Before, it came out expired."""
    sched = make_scheduler("kv_producer", BS, {"lease_s": 0.5})
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    update = sched.update_from_output

    def long_step(out, runner):
        time.sleep(0.8)  # sampling, after the prompt was staged
        return update(out, runner)

    monkeypatch.setattr(sched, "update_from_output", long_step)
    try:
        sched.add_request(make_request("h1", 20, {"do_remote_decode": True}))
        _, outputs = step(sched)
        assert params_of(outputs, "h1")["expires_at"] > time.time() + 0.3
        assert sched.connector.scheduler.pool.has("h1")
    finally:
        sched.connector.shutdown()


# One page: the header and 16 tokens x 2 layers of KV.
ONE_PAGE = {"staging_bytes": 16384 + HEADER_BYTES, "staging_page_bytes": 16384 + HEADER_BYTES}


def test_full_pool_gives_a_clear_error_after_the_bounded_wait():
    # Saves in the step: f1's blocks come back at once (async saves hold them for the
    # worker's save thread, which this scheduler-only test has not).
    cfg = {**ONE_PAGE, "staging_wait_s": 0.0, "async_saves": False}
    sched = make_scheduler("kv_producer", BS, cfg)
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        free_before = free_blocks(sched)
        sched.add_request(make_request("f1", 16, {"do_remote_decode": True}))
        sched.add_request(make_request("f2", 16, {"do_remote_decode": True}, first=40))
        _, outputs = step(sched)
        assert params_of(outputs, "f1")["do_remote_prefill"] is True
        err = params_of(outputs, "f2")
        assert err["do_remote_prefill"] is False and "staging pool full" in err["error"]
        assert free_blocks(sched) == free_before
        assert sched.connector.scheduler.pool.pages_in_use == 1  # only f1's lease
    finally:
        sched.connector.shutdown()


def test_full_pool_back_pressure_waits_then_stages():
    sched = make_scheduler("kv_producer", BS, {**ONE_PAGE, "staging_wait_s": 60.0})
    pool = sched.connector.scheduler.pool
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        sched.add_request(make_request("w1", 16, {"do_remote_decode": True}))
        sched.add_request(make_request("w2", 16, {"do_remote_decode": True}, first=40))
        out, _ = step(sched)
        assert list(out.num_scheduled_tokens) == ["w1"]  # w2 waits for pages, not the engine
        out, _ = step(sched)
        assert "w2" not in out.num_scheduled_tokens and pool.pages_in_use == 1
        pool.release("w1")  # the decode acknowledged w1
        out, outputs = step(sched)
        assert [s.request_id for s in meta(out).saves] == ["w2"]
        assert params_of(outputs, "w2")["do_remote_prefill"] is True
    finally:
        sched.connector.shutdown()


def test_a_decode_that_stops_reading_holds_only_its_share_of_staging():
    """Two decodes in play, one stops acknowledging: its handoffs stop at its share of the
    pool (then fail by name), and the healthy decode's still stage. Before the share, the
    slow decode's took every page and the healthy one's failed with "staging pool full"."""
    decodes = [make_scheduler("kv_consumer", BS, engine_id=f"dec{i}") for i in range(2)]
    page = 16384 + HEADER_BYTES
    cfg = {"staging_bytes": 4 * page, "staging_page_bytes": page, "staging_wait_s": 0.0,
           "async_saves": False}  # fmt: skip
    sched = make_scheduler("kv_producer", BS, cfg)
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    pool = sched.connector.scheduler.pool
    ports = [d.connector.scheduler._server.port for d in decodes]
    named = [{"do_remote_decode": True, "decode_host": "127.0.0.1", "decode_port": p}
             for p in ports]  # fmt: skip
    try:
        for d in decodes:
            d.connector.scheduler.set_rank_metadata([rank_meta(engine_id="dec")])

        def run(rids: list[str]) -> dict[str, dict]:
            results: dict[str, dict] = {}
            for _ in range(500):  # requests wait for their decode's handshake, then run
                _, outputs = step(sched)
                results |= {r: params_of(outputs, r) for r in rids if params_of(outputs, r)}
                if len(results) == len(rids):
                    return results
                time.sleep(0.01)
            raise AssertionError(f"finished only {sorted(results)}")

        for i, params in enumerate(named):  # both decodes served and read one each
            sched.add_request(make_request(f"first{i}", 16, dict(params), first=1 + i))
            assert run([f"first{i}"])[f"first{i}"]["do_remote_prefill"] is True
            pool.release(f"first{i}")
        slow = [f"slow{i}" for i in range(6)]  # more than the pool holds
        for i, rid in enumerate(slow):
            sched.add_request(make_request(rid, 16, dict(named[0]), first=20 + i))
        sched.add_request(make_request("healthy1", 16, dict(named[1]), first=60))
        results = run([*slow, "healthy1"])
        staged = sorted(r for r, p in results.items() if p["do_remote_prefill"])
        assert staged == ["healthy1", "slow0", "slow1"], results
        assert f"decode 127.0.0.1:{ports[0]} held its share" in results["slow5"]["error"]
        assert pool.pages_held_by(f"127.0.0.1:{ports[0]}") == 2
    finally:
        for s in (sched, *decodes):
            s.connector.shutdown()


def test_decode_waits_for_remote_kv_then_runs(decode):
    req = make_request("d1", 45, remote_params(45), max_tokens=3)
    decode.add_request(req)
    out, _ = step(decode)
    loads = meta(out).loads
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(loads) == 1 and loads[0].first_token == 0 and loads[0].error is None
    assert loads[0].block_ids == tuple(decode.kv_cache_manager.get_block_ids("d1"))
    assert loads[0].remote.num_tokens == 45
    assert meta(out).idle  # nothing computed: the worker may wait a moment for the load
    step(decode, KVConnectorOutput(finished_recving={"d1"}))
    out, _ = step(decode)
    # Only the last prompt token is recomputed locally.
    assert req.status == RequestStatus.RUNNING
    assert req.num_computed_tokens >= 45
    assert not meta(out).idle


def test_decode_malformed_params_become_a_load_error(decode):
    bad = remote_params(45)
    del bad["staging_offset"]
    decode.add_request(make_request("m1", 45, bad))
    out, _ = step(decode)
    (load,) = meta(out).loads
    assert load.remote is None and "staging_offset" in load.error


# Every field of the router's params, sent as what no field may hold (and a port the named
# host cannot have): generated from the struct, so a field added later is tried too.
MALFORMED = [
    *((field.name, [1]) for field in msgspec.structs.fields(RoutedParams)),
    ("decode_port", 0),
]


@pytest.mark.parametrize(("field", "value"), MALFORMED, ids=[f for f, _ in MALFORMED])
def test_malformed_router_params_are_a_named_refusal_on_both_sides(prefill, decode, field, value):
    """A prefill returns the refusal, naming the field, where its ticket would be; the
    decode fails the load with it (kv_load_failure_policy decides). Neither stages."""
    sent = {"do_remote_decode": True, "decode_host": "127.0.0.1", field: value}
    prefill.add_request(make_request("p1", 40, sent, first=1))
    returned = None
    for _ in range(20):
        _, outputs = step(prefill)
        if returned := params_of(outputs, "p1"):
            break
    assert returned is not None and returned["do_remote_prefill"] is False, returned
    assert "malformed kv_transfer_params" in returned["error"] and field in returned["error"]
    assert prefill.connector.scheduler.pool.pages_in_use == 0
    to_decode = {**remote_params(40), "decode_host": "127.0.0.1", field: value}
    decode.add_request(make_request("d1", 40, to_decode))
    out, _ = step(decode)
    (load,) = meta(out).loads
    assert load.remote is None and field in load.error, load.error


def test_two_live_requests_with_one_id_each_keep_their_own_params(prefill):
    """vLLM's id randomization off, a client's id reused while the first runs: the params
    are decoded per request, so a plain request never acts on a handoff's under its id."""
    handoff = make_request("same", 40, dict(ROUTER_PARAMS))
    plain = make_request("same", 40)
    connector = prefill.connector
    connector.on_new_request(handoff)
    connector.on_new_request(plain)
    assert connector.get_num_new_matched_tokens(plain, 0) == (0, False)
    assert not connector.scheduler.sender.outgoing("same")  # no handoff begun for it
    connector.get_num_new_matched_tokens(handoff, 0)
    assert connector.scheduler.sender.outgoing("same")


def test_decode_abort_mid_load_holds_blocks_until_worker_reports(decode):
    free_before = free_blocks(decode)
    decode.add_request(make_request("x1", 45, remote_params(45)))
    step(decode)
    decode.finish_requests("x1", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(decode) < free_before  # the worker may still be writing them
    step(decode, KVConnectorOutput(finished_recving={"x1"}))
    assert free_blocks(decode) == free_before


def test_decode_abort_before_load_is_scheduled(decode):
    free_before = free_blocks(decode)
    decode.add_request(make_request("y1", 45, remote_params(45)))
    decode.finish_requests("y1", RequestStatus.FINISHED_ABORTED)
    out, _ = step(decode)
    assert meta(out).loads == []
    assert free_blocks(decode) == free_before


def test_decode_abort_after_load_frees_everything(decode):
    free_before = free_blocks(decode)
    decode.add_request(make_request("z1", 45, remote_params(45), max_tokens=5))
    step(decode)
    step(decode, KVConnectorOutput(finished_recving={"z1"}))
    step(decode)
    decode.finish_requests("z1", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(decode) == free_before


def test_prefill_stages_in_the_named_decodes_format(decode):
    """The proxy names the decode; the prefill handshakes with it (without blocking the
    engine) and stages in the decode's layout and block size."""
    dec_side = decode.connector.scheduler
    dec_meta = msgspec_replace(rank_meta(engine_id="dec"), block_size=64, layout_kind="LBHNC")
    dec_side.set_rank_metadata([dec_meta])
    sched = make_scheduler("kv_producer", BS)
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        port = dec_side._server.port
        sched.add_request(
            make_request(
                "t1",
                70,
                {"do_remote_decode": True, "decode_host": "127.0.0.1", "decode_port": port},
            )
        )
        spec = None
        for _ in range(500):  # the request waits for the handshake, then runs
            out, outputs = step(sched)
            if meta(out).saves:
                spec = meta(out).saves[0]
                break
            time.sleep(0.01)
        assert spec is not None
        assert (spec.layout_kind, spec.block_size) == ("LBHNC", 64)
        assert len(spec.block_ids[0]) == 5  # the prefill's own 16-token blocks
        params = params_of(outputs, "t1")
        assert params["staged_layout"] == "LBHNC" and params["staged_block_size"] == 64
    finally:
        sched.connector.shutdown()


def staged_format(sched, rid: str) -> tuple[str, int]:
    sched.add_request(make_request(rid, 70, dict(ROUTER_PARAMS)))
    for _ in range(100):
        out, _ = step(sched)
        if meta(out).saves:
            spec = meta(out).saves[0]
            return spec.layout_kind, spec.block_size
    raise AssertionError(f"{rid} was never saved")


def test_behind_a_router_the_prefill_stages_in_its_decode_peers_format():
    """No decode named in the params: the decodes in ``decode_peers`` (handshaken at
    start-up) decide when they agree; where they differ, or before they answer, the
    prefill stages in its own format and the decodes convert."""
    decodes = [make_scheduler("kv_consumer", BS, engine_id=f"dec{i}") for i in range(3)]
    formats = [("LBHNC", 64), ("LBHNC", 64), ("LBNHC", 32)]
    prefills = []
    try:
        for d, (kind, block) in zip(decodes, formats, strict=True):
            d.connector.scheduler.set_rank_metadata(
                [msgspec_replace(rank_meta(engine_id="d"), block_size=block, layout_kind=kind)]
            )
        peers = [f"127.0.0.1:{d.connector.scheduler._server.port}" for d in decodes]
        for fleet in (peers[:2], peers):
            sched = make_scheduler("kv_producer", BS, {"decode_peers": fleet})
            sched.connector.scheduler.set_rank_metadata([rank_meta()])
            prefills.append(sched)
        agreeing, mixed = prefills
        deadline = time.monotonic() + 20  # the start-up handshakes answer
        while staged_format(agreeing, f"a{time.monotonic()}") != ("LBHNC", 64):
            assert time.monotonic() < deadline, "never staged in the decodes' format"
            time.sleep(0.05)
        assert staged_format(mixed, "m1") == ("vllm_cpu_vec", BS)  # they differ: our own
    finally:
        for sched in [*prefills, *decodes]:
            sched.connector.shutdown()


def test_n_above_one_is_refused_by_name(prefill):
    """vLLM splits ``n = 2`` into two requests, "0_<id>" and "1_<id>", before the engine: the
    prefill stages neither and each gets an error naming the problem, which a decode takes
    as a failed load (kv_load_failure_policy); a plain request beside them stages."""
    for rid in ("0_cmpl-n2", "1_cmpl-n2", "cmpl-n1"):
        prefill.add_request(make_request(rid, 40, {"do_remote_decode": True}))
    params, saved = {}, set()
    for _ in range(50):
        out, outputs = step(prefill)
        saved |= {s.request_id for s in meta(out).saves}
        params |= {r: p for r in ("0_cmpl-n2", "1_cmpl-n2", "cmpl-n1")
                   if (p := params_of(outputs, r)) is not None}  # fmt: skip
        if len(params) == 3:
            break
    assert saved == {"cmpl-n1"}
    for rid in ("0_cmpl-n2", "1_cmpl-n2"):
        assert "n > 1" in params[rid]["error"] and not params[rid]["do_remote_prefill"]
    assert params["cmpl-n1"]["do_remote_prefill"] is True


def test_decode_peers_must_be_host_and_port():
    with pytest.raises(ValueError, match="decode_peers"):
        parse_config({"decode_peers": ["127.0.0.1"]})


def test_unreachable_decode_falls_back_to_own_format():
    sched = make_scheduler("kv_producer", BS, {"handshake_timeout_s": 0.3})
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        sched.add_request(
            make_request(
                "u1", 40, {"do_remote_decode": True, "decode_host": "127.0.0.1", "decode_port": 1}
            )
        )
        spec = None
        for _ in range(400):
            out, _ = step(sched)
            if meta(out).saves:
                spec = meta(out).saves[0]
                break
            time.sleep(0.01)
        assert spec is not None and (spec.layout_kind, spec.block_size) == ("vllm_cpu_vec", BS)
    finally:
        sched.connector.shutdown()


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


def test_staging_is_freed_only_when_every_decode_rank_acknowledged(prefill):
    pool = prefill.connector.scheduler.pool
    prefill.add_request(make_request("k1", 40, {"do_remote_decode": True}))
    _, outputs = step(prefill)
    params = params_of(outputs, "k1")
    host, port = params["remote_host"], params["remote_port"]
    side_channel.call(host, port, ReleaseRequest(["k1"], 0, 2), None, 5.0)
    side_channel.call(host, port, ReleaseRequest(["k1"], 0, 2), None, 5.0)  # a repeat
    assert pool.has("k1")  # rank 1 may still be reading
    side_channel.call(host, port, ReleaseRequest(["k1"], 1, 2), None, 5.0)
    assert not pool.has("k1")


def test_params_staged_for_another_prompt_become_a_load_error(decode):
    """A's prompt with B's ticket (same length, other tokens): never loaded as A's KV."""
    decode.add_request(make_request("pa", 45, remote_params(45, first=9)))
    out, _ = step(decode)
    (load,) = meta(out).loads
    assert load.remote is None and "another prompt" in load.error


def test_a_ticket_refused_at_claim_is_neither_renewed_nor_released():
    """Renewals start at arrival, before the ticket's prompt is checked. A request that
    carries another prompt's ticket (a client replaying it) is refused at claim, and its
    end must not release the staging the ticket's own request still needs."""
    sched = make_scheduler("kv_producer", BS, {"lease_s": 60.0})
    side = sched.connector.scheduler
    side.set_rank_metadata([rank_meta()])
    decode = make_scheduler("kv_consumer", BS, ASYNC, engine_id="dec")
    try:
        sched.add_request(make_request("p1", 45, {"do_remote_decode": True}))
        params = params_of(step(sched)[1], "p1")
        decode.add_request(make_request("replay", 45, dict(params), first=9))
        out, _ = step(decode)
        (load,) = meta(out).loads
        assert "another prompt" in load.error
        assert decode.connector.scheduler.receiver.renewer.holds_until("replay") == 0.0
        decode.finish_requests("replay", RequestStatus.FINISHED_ABORTED)
        step(decode, KVConnectorOutput(finished_recving={"replay"}))
        time.sleep(0.5)  # a release would go out on a thread of its own
        step(sched)
        assert side.pool.has("p1"), "the replayed ticket's end freed the real request's KV"
    finally:
        decode.connector.shutdown()
        sched.connector.shutdown()


def test_prefill_ticket_binds_prompt_and_generation(prefill):
    prefill.add_request(make_request("g1", 40, {"do_remote_decode": True}))
    prefill.add_request(make_request("g2", 40, {"do_remote_decode": True}, first=70))
    out, outputs = step(prefill)
    saves = {s.request_id: s for s in meta(out).saves}
    p1, p2 = params_of(outputs, "g1"), params_of(outputs, "g2")
    assert p1["generation"] == saves["g1"].generation != p2["generation"] > 0
    assert p1["prompt_hash"] == prompt_hash(make_request("x", 40).prompt_token_ids)
    assert p1["prompt_hash"] != p2["prompt_hash"]
    assert p1["incarnation"] == "feedfacefeedface" and p1["lease_s"] == 60.0
    # The region holds a header before the KV.
    pool = prefill.connector.scheduler.pool
    assert pool.pages_for(HEADER_BYTES + 3 * BS * 2 * 2 * 2 * 32 * 4) >= 1


def test_released_regions_are_invalidated_at_the_next_step(prefill):
    prefill.add_request(make_request("v1", 40, {"do_remote_decode": True}))
    _, outputs = step(prefill)
    params = params_of(outputs, "v1")
    side_channel.call(
        params["remote_host"], params["remote_port"], ReleaseRequest(["v1"]), None, 5.0
    )
    out, _ = step(prefill)
    assert meta(out).invalidate == [params["staging_offset"]]
    out, _ = step(prefill)
    assert meta(out).invalidate == []


@pytest.mark.parametrize(
    "heads,src_tp,dst_tp",
    [(2, 2, 1), (2, 1, 2), (2, 2, 2), (4, 2, 4), (2, 4, 1)],
    ids=["P2-D1", "P1-D2", "P2-D2", "P2-D4", "GQA-P4-D1"],
)
def test_staging_freed_only_after_every_read_pair(heads, src_tp, dst_tp):
    """NIXL acknowledgements, one per (decode rank, prefill rank) read, fed one at a time
    through update_connector_output: the staging goes with the last needed one."""
    from vllm_qaic_connector.kv.tp_mapping import head_sources

    sched = make_scheduler("kv_producer", BS)
    side = sched.connector.scheduler
    side.set_rank_metadata(
        [
            msgspec_replace(rank_meta(tp_rank=r, tp_size=src_tp), num_kv_heads=heads)
            for r in range(src_tp)
        ]
    )
    try:
        sched.add_request(make_request("q1", 40, {"do_remote_decode": True}))
        step(sched)
        pairs = [
            (d, s.src_rank) for d in range(dst_tp) for s in head_sources(heads, src_tp, dst_tp, d)
        ]
        assert len(pairs) >= 2
        for i, (d, src) in enumerate(pairs):
            assert side.pool.has("q1"), f"freed before read {i} of {len(pairs)}"
            ack = ReleaseRequest(["q1"], d, dst_tp, [src])
            side.update_connector_output(None, [ack, ack])  # a repeat counts once
        assert not side.pool.has("q1")
    finally:
        sched.connector.shutdown()


def test_leases_renewed_while_the_decode_wants_the_kv(decode):
    """The prefill's lease is 0.6 s; a decode that still waits on the KV renews it, and
    once the decode is done (or gone) it runs out."""
    sched = make_scheduler("kv_producer", BS, {"lease_s": 0.6})
    side = sched.connector.scheduler
    side.set_rank_metadata([rank_meta()])
    try:
        sched.add_request(make_request("p1", 45, {"do_remote_decode": True}))
        _, outputs = step(sched)
        params = params_of(outputs, "p1")
        decode.add_request(make_request("d1", 45, params, max_tokens=3))
        step(decode)  # the load is handed to the worker, which has not finished it
        time.sleep(2.0)
        side.pool.expire()
        assert side.pool.has("p1"), "the lease ran out while the decode still wanted it"
        # The decode knows the renewals took: the lease holds past the ticket's expiry.
        renewed_until = decode.connector.scheduler.receiver.renewer.holds_until("d1")
        assert renewed_until > params["expires_at"] + 1.0
        step(decode, KVConnectorOutput(finished_recving={"d1"}))  # loaded: renewals stop
        time.sleep(1.5)
        side.pool.expire()
        assert not side.pool.has("p1")
    finally:
        sched.connector.shutdown()


def test_a_queued_request_s_lease_is_renewed_from_its_arrival():
    """A decode busy at --max-num-seqs 1: vLLM looks at a queued request (and asks the
    connector) only when a seat frees, so renewals that began there let a 0.6 s lease run
    out while it queued (HTTP 502 under vLLM's default policy, or a recompute). They
    begin when the request arrives: after 2 s in the queue its KV is still staged and
    loads."""
    sched = make_scheduler("kv_producer", BS, {"lease_s": 0.6})
    side = sched.connector.scheduler
    side.set_rank_metadata([rank_meta()])
    decode = make_scheduler("kv_consumer", BS, engine_id="dec", max_num_seqs=1)
    try:
        sched.add_request(make_request("p1", 45, {"do_remote_decode": True}))
        params = params_of(step(sched)[1], "p1")
        decode.add_request(make_request("busy", 20, max_tokens=1000, first=90))
        step(decode)
        decode.add_request(make_request("d1", 45, params, max_tokens=3))
        for _ in range(20):  # the busy request runs; d1 waits for its seat
            out, _ = step(decode)
            assert "d1" not in out.num_scheduled_tokens and not meta(out).loads
            time.sleep(0.1)
        side.pool.expire()
        assert side.pool.has("p1"), "the lease ran out while the request queued"
        decode.finish_requests("busy", RequestStatus.FINISHED_ABORTED)
        out, _ = step(decode)
        [load] = meta(out).loads
        assert load.request_id == "d1" and load.error is None
        assert load.holds_until > params["expires_at"] + 1.0  # renewed while it queued
    finally:
        decode.connector.shutdown()
        sched.connector.shutdown()


def signed_pair(monkeypatch, key: str):
    monkeypatch.setenv(KEY_ENV, key)
    sched = make_scheduler("kv_producer", BS, {"lease_s": 60.0})
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    return sched


@pytest.mark.parametrize(
    "edit",
    [
        {"staging_offset": 4096},
        {"generation": 12345},
        {"remote_request_id": "someone-else"},
        {"expires_at": time.time() + 3600},
        {"remote_port": 2},
        {"remote_engine_id": "another-engine"},
        {"adapter": "0123456789abcdef"},
        {"ticket_mac": ""},
        {"ticket_mac": "00" * 32},
    ],
)
def test_edited_signed_ticket_is_a_load_error(monkeypatch, edit):
    """With a key, every field of the returned params but the host is signed: an edit is
    refused before the decode contacts anyone, and the untouched ticket still works."""
    sched = signed_pair(monkeypatch, "k" * 32)
    decode = make_scheduler("kv_consumer", BS, engine_id="dec")
    try:
        sched.add_request(make_request("p1", 45, {"do_remote_decode": True}))
        _, outputs = step(sched)
        params = params_of(outputs, "p1")
        assert params is not None and len(params["ticket_mac"]) == 64
        decode.add_request(make_request("good", 45, dict(params), max_tokens=3))
        decode.add_request(make_request("bad", 45, {**params, **edit}, max_tokens=3))
        out, _ = step(decode)
        loads = {spec.request_id: spec for spec in meta(out).loads}
        assert loads["good"].error is None and loads["good"].remote is not None
        bad = loads["bad"]
        assert bad.remote is None and "ticket_mac" in bad.error, bad.error
        assert "k" * 16 not in bad.error
    finally:
        decode.connector.shutdown()
        sched.connector.shutdown()


def test_ticket_signed_with_another_key_is_refused(monkeypatch):
    sched = signed_pair(monkeypatch, "a" * 32)
    try:
        sched.add_request(make_request("p1", 45, {"do_remote_decode": True}))
        _, outputs = step(sched)
        params = params_of(outputs, "p1")
    finally:
        sched.connector.shutdown()
    monkeypatch.setenv(KEY_ENV, "b" * 32)
    decode = make_scheduler("kv_consumer", BS, engine_id="dec")
    try:
        decode.add_request(make_request("d1", 45, params, max_tokens=3))
        out, _ = step(decode)
        (load,) = meta(out).loads
        assert load.remote is None and "forged or edited" in load.error
    finally:
        decode.connector.shutdown()


def test_expired_ticket_is_a_load_error_and_a_live_one_carries_its_deadline(decode):
    stale = remote_params(45)
    stale["expires_at"] = time.time() - 5
    decode.add_request(make_request("old", 45, stale, max_tokens=3))
    fresh = remote_params(45)
    decode.add_request(make_request("new", 45, fresh, max_tokens=3))
    out, _ = step(decode)
    loads = {spec.request_id: spec for spec in meta(out).loads}
    assert loads["old"].remote is None and "expired" in loads["old"].error
    assert loads["new"].error is None and loads["new"].holds_until == fresh["expires_at"]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_prefills_error_passed_on_by_a_router_is_a_load_error(decode, policy):
    """vllm-router copies the prefill's params whole: one that says the handoff failed is
    a failed load (kv_load_failure_policy decides), not a silent recompute."""
    decode.recompute_kv_load_failures = policy == "recompute"
    params = {"do_remote_prefill": False, "error": "staging pool full (8/8 pages) for 5s"}
    decode.add_request(make_request("e1", 45, params))
    out, _ = step(decode)
    (load,) = meta(out).loads
    assert load.remote is None and "staging pool full" in load.error
    assert load.block_ids == tuple(decode.kv_cache_manager.get_block_ids("e1"))
    # The worker reports the failure as it does; the request is recomputed, once. Before,
    # the params still said "error" to the rescheduled request: it claimed them again,
    # failed again, and so on every step, forever (the client hung, the log flooded).
    failed = KVConnectorOutput(
        finished_recving={"e1"}, failed_recving={"e1"}, invalid_block_ids=set(load.block_ids[0])
    )
    out, _ = step(decode, failed)
    claims = len(meta(out).loads)
    for _ in range(3):
        out, _ = step(decode)
        claims += len(meta(out).loads)
    assert claims == 0 and "e1" not in decode.requests  # recomputed, answered, done


def test_a_ticket_claimed_but_never_read_is_released_when_the_request_goes():
    """A request that waited with a verified ticket (for blocks, in the queue) and was then
    aborted: the prefill hears at once, instead of holding the staging for lease_s."""
    from vllm_qaic_connector.config import parse_config
    from vllm_qaic_connector.protocol.side_channel import SideChannelServer
    from vllm_qaic_connector.protocol.wire import Message, Ok
    from vllm_qaic_connector.scheduler.kv_receiver import KVReceiver

    released: list[str] = []

    def handle(msg: Message) -> Message:
        if isinstance(msg, ReleaseRequest):
            released.extend(msg.request_ids)
        return Ok()

    server = SideChannelServer("127.0.0.1", 0, handle, None)
    loads = KVReceiver(parse_config({}), ())
    try:
        req = make_request("w1", 45, remote_params(45, port=server.port))
        routed = RoutedParams(do_remote_prefill=True)
        assert loads.claim(req, 0, routed) == (45, True)  # verified: renewed while it waits
        assert loads.finished("w1") is False  # gone before its load started
        deadline = time.monotonic() + 10
        while not released and time.monotonic() < deadline:
            time.sleep(0.02)
        assert released == ["p1"]
    finally:
        loads.close()
        server.close()


def test_each_data_parallel_rank_listens_on_its_own_side_channel_port():
    """vLLM runs each data-parallel rank as an engine of its own, from one config but its
    DP index: with a fixed side_channel_port the second one failed to bind and the server
    never started. Each listens on the port plus its index, as NixlConnector's do."""
    base = free_port()
    decodes = [
        make_scheduler(
            "kv_consumer", BS, {"side_channel_port": base}, engine_id=f"dp{i}", dp_index=i
        )
        for i in (0, 1)
    ]
    try:
        assert [d.connector.scheduler._server.port for d in decodes] == [base, base + 1]
    finally:
        for d in decodes:
            d.connector.shutdown()


def test_a_prefill_preempted_between_chunks_names_itself_to_the_worker_and_stages_every_token():
    """KV pressure on a kv_both engine: a plain request's growth preempts a handoff
    mid-prompt (admission without reserving whole prompts, ``--no-scheduler-reserve-full-isl``).
    vLLM frees its blocks at once, so the step's metadata names it (the worker's
    ``handle_preemptions`` lets its saves finish before the forward reuses them); when it
    resumes, the chunks staged before still count and every prompt token is staged."""
    sched = make_scheduler("kv_both", BS, {"async_saves": True}, num_blocks=8, max_batched=16)
    sched.scheduler_reserve_full_isl = False
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        sched.add_request(make_request("plain", 16, None, max_tokens=60, first=9))
        sched.add_request(make_request("p1", 96, {"do_remote_decode": True}))
        preempted_steps, staged, ticket = 0, set[int](), None
        for _ in range(100):
            out, outputs = step(sched)
            if "p1" in (out.preempted_req_ids or ()):
                preempted_steps += 1
                assert meta(out).preempted == ["p1"]
            else:
                assert meta(out).preempted == []
            for save in meta(out).saves:
                staged.update(range(save.first, save.last))
            if ticket := params_of(outputs, "p1"):
                break
        assert preempted_steps > 0, "no preemption: the test lost its KV pressure"
        assert ticket and ticket["do_remote_prefill"] and ticket["num_tokens"] == 96
        assert staged == set(range(96))
    finally:
        sched.connector.shutdown()


@pytest.mark.parametrize(
    ("request_id", "position"),
    [
        ("cmpl-9d3492414fbfbc22-0-a7a6f6fe", None),  # a single prompt: prompt 0
        ("cmpl-9d3492414fbfbc22-2-a7a6f6fe", 2),
        ("cmpl-my-id-7-0-a7a6f6fe", None),  # X-Request-Id "my-id-7", one prompt
        ("cmpl-my-id-7-1-a7a6f6fe", 1),
        ("chatcmpl-9d3492414fbfbc22-1-a7a6f6fe", None),  # chat has no prompt lists
        ("cmpl-9d3492414fbfbc22-1", None),  # without the engine's suffix: not vLLM's shape
    ],
)
def test_a_later_prompt_of_a_list_is_read_from_vllm_s_request_id(request_id, position):
    from vllm_qaic_connector.scheduler.request_ids import later_prompt_of_a_list

    assert later_prompt_of_a_list(request_id) == position


def test_sampling_children_read_their_one_ticket_once(decode):
    """vLLM runs a request for n > 1 choices as n requests with one ticket, and the first
    read frees the prefill's staging: a second read would fail. One child loads; the others
    wait for it (vLLM asks again each step), then start from its blocks in the prefix
    cache. Before, every child read the ticket, and each that came after the first's
    acknowledgement failed its load."""
    kids = [make_request(f"{i}_parent", 45, remote_params(45), max_tokens=3) for i in range(3)]
    for kid in kids:
        decode.add_request(kid)
    for first in (True, False):  # however long the load takes
        out, _ = step(decode)
        assert [load.request_id for load in meta(out).loads] == ["0_parent"] * first
        assert [kid.status for kid in kids[1:]] == [RequestStatus.WAITING] * 2
    step(decode, KVConnectorOutput(finished_recving={"0_parent"}))
    out, _ = step(decode)
    assert meta(out).loads == []
    assert all(kid.status == RequestStatus.RUNNING for kid in kids)
    started = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    full_blocks = 45 // BS * BS
    assert {r: started.get(r) for r in ("1_parent", "2_parent")} == dict.fromkeys(
        ("1_parent", "2_parent"), full_blocks)  # fmt: skip


def test_a_sampling_child_aborted_mid_load_leaves_its_siblings_to_compute(decode):
    kids = [make_request(f"{i}_parent", 45, remote_params(45), max_tokens=3) for i in range(2)]
    for kid in kids:
        decode.add_request(kid)
    step(decode)
    decode.finish_requests("0_parent", RequestStatus.FINISHED_ABORTED)
    out, _ = step(decode, KVConnectorOutput(finished_recving={"0_parent"}))
    assert meta(out).loads == [] and kids[1].status == RequestStatus.RUNNING


def test_without_a_prefix_cache_each_sampling_child_reads_the_ticket():
    """Waiting for a sibling's read would leave nothing to start from: each child reads
    the ticket (all in the step they arrive in, before any acknowledgement)."""
    decode = make_scheduler("kv_consumer", BS, engine_id="dec", prefix_caching=False)
    try:
        for i in range(3):
            decode.add_request(make_request(f"{i}_parent", 45, remote_params(45)))
        out, _ = step(decode)
        assert sorted(load.request_id for load in meta(out).loads) == [
            "0_parent", "1_parent", "2_parent"]  # fmt: skip
    finally:
        decode.connector.shutdown()


def test_a_request_id_used_again_within_its_lease_is_refused_and_leaves_the_first_alone(prefill):
    """Request ids repeat where vLLM's randomization is off and a client repeats its
    X-Request-Id: the second request with a staged id gets a clean error in its params;
    the first one's staging stays until its own decode releases it."""
    pool = prefill.connector.scheduler.pool
    prefill.add_request(make_request("p1", 45, {"do_remote_decode": True}))
    _, outputs = step(prefill)
    first = params_of(outputs, "p1")
    step(prefill, KVConnectorOutput(finished_sending={"p1"}))
    prefill.add_request(make_request("p1", 45, {"do_remote_decode": True}, first=9))
    _, outputs = step(prefill)
    again = params_of(outputs, "p1")
    assert again["do_remote_prefill"] is False and "already staged" in again["error"]
    assert pool.has("p1") and first["do_remote_prefill"] is True
    side_channel.call(first["remote_host"], first["remote_port"], ReleaseRequest(["p1"]), None, 5.0)
    assert pool.pages_in_use == 0


@pytest.fixture
def shm_decode():
    sched = make_scheduler("kv_consumer", BS, {"sync_loads": True}, engine_id="dec")  # shm
    yield sched
    sched.connector.shutdown()


def test_in_step_a_shm_load_runs_in_the_step_that_claims_it(shm_decode):
    """Over shm the worker copies the KV before the step's forward pass, so the request
    computes its last prompt token and samples in the very step that claims it. An
    asynchronous load waits for the worker's report, then for the step after it."""
    req = make_request("s1", 45, remote_params(45), max_tokens=3)
    shm_decode.add_request(req)
    out, _ = step(shm_decode)
    (load,) = meta(out).loads
    assert load.in_step and load.error is None and (load.first_token, load.claimed) == (0, 44)
    assert out.has_sync_kv_loads and out.num_scheduled_tokens == {"s1": 1}
    assert req.status == RequestStatus.RUNNING and list(req.output_token_ids) == [7]
    # Over with the step: no more renewals, and nothing for the worker to report.
    assert shm_decode.connector.scheduler.receiver.renewer.holds_until("s1") == 0.0
    out, _ = step(shm_decode)
    assert meta(out).loads == [] and list(req.output_token_ids) == [7, 7]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_in_step_a_failed_load_fails_the_request_or_is_recomputed(shm_decode, policy):
    """The worker reports a load in the step that failed by its blocks, with that step's
    output: vLLM drops the token sampled from them, then fails the request or computes
    the whole prompt (never claiming the ticket again)."""
    shm_decode.recompute_kv_load_failures = policy == "recompute"
    params = {"do_remote_prefill": False, "error": "staging pool full (8/8 pages) for 5s"}
    req = make_request("e1", 45, params, max_tokens=3)
    shm_decode.add_request(req)
    out = shm_decode.schedule()
    (load,) = meta(out).loads
    assert load.in_step and "staging pool full" in load.error
    failed = KVConnectorOutput(invalid_block_ids=set(load.block_ids[0]))
    runner = ModelRunnerOutput(req_ids=["e1"], req_id_to_index={"e1": 0},
                               sampled_token_ids=[[7]], kv_connector_output=failed)  # fmt: skip
    shm_decode.update_from_output(out, runner)
    assert list(req.output_token_ids) == []
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR and "e1" not in shm_decode.requests
        return
    out, _ = step(shm_decode)
    assert meta(out).loads == [] and out.num_scheduled_tokens == {"e1": 45}
    assert list(req.output_token_ids) == [7]
