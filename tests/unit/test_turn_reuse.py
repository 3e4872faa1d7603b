"""Multi-turn reuse (``reuse_turns``), in real vLLM Schedulers with real Requests: a decode
keeps a finished turn's blocks and hands out a ticket for them; the conversation's next
prefill loads the history it lacks from it, only after its prompt proves to begin with
exactly those tokens."""

from __future__ import annotations

import os
import random
import time

import msgspec
import pytest
import torch
from vllm import SamplingParams
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from testbed.handshake_ranks import rank_meta
from testbed.vllm_harness import (
    BS,
    free_blocks,
    make_request,
    make_scheduler,
    meta,
    params_of,
    step,
)
from testbed.worker_processes import make_worker
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.keys import KEY_ENV
from vllm_qaic_connector.protocol.ticket import (
    block_chain,
    parse_remote_prefill,
    prompt_hash,
    ticket_binding,
)
from vllm_qaic_connector.protocol.wire import ErrorReply, ReleaseRequest, TurnReply, TurnRequest
from vllm_qaic_connector.region_headers import (
    HEADER_BYTES,
    StaleTicket,
    checked_read,
    header_generation,
)
from vllm_qaic_connector.transports.shm import ShmTransport

REUSE = {"reuse_turns": True, "lease_s": 60.0}


@pytest.fixture
def decode():
    sched = make_scheduler("kv_both", BS, REUSE, engine_id="dec", load_failure_policy="recompute")
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    yield sched
    sched.connector.shutdown()


@pytest.fixture
def prefill():
    sched = make_scheduler("kv_producer", BS, REUSE, load_failure_policy="recompute")
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    yield sched
    sched.connector.shutdown()


def counted(sched, name: str) -> list[int]:
    """Each step's ``name`` counter, as vLLM's scheduler takes the stats at every step."""
    side, taken = sched.connector.scheduler, []
    pool_stats = side.pool_stats

    def taking():
        stats = pool_stats()
        taken.append(stats.data.get(name, 0))
        return stats

    side.pool_stats = taking
    return taken


def finish_turn(
    decode, rid: str, prompt: int, answer: int, first: int = 5, keep: dict | str | None = None
) -> dict | None:
    """Runs a turn of ``prompt`` tokens answered with ``answer`` tokens, asked to keep it
    (``keep``: a ``turn_id`` to name it by, or the params themselves); its ticket."""
    params = keep if isinstance(keep, dict) else {"keep_turn": True, "turn_id": keep}
    decode.add_request(make_request(rid, prompt, params, answer, first=first))
    for _ in range(answer):
        _, outputs = step(decode)
        done = [o for outs in outputs.values() for o in outs.outputs if o.request_id == rid]
        if done and done[0].finish_reason is not None:
            return done[0].kv_transfer_params
    raise AssertionError(f"{rid} did not finish")


def test_a_decode_keeps_a_finished_turn_until_its_ticket_is_released(decode):
    total, kept = free_blocks(decode), counted(decode, "kept_turns")
    ticket = finish_turn(decode, "t1", 40, 10)
    tokens = make_request("x", 40).prompt_token_ids + [7] * 10
    # The answer's last token has no KV yet: the ticket covers every token before it.
    assert ticket["num_tokens"] == 49
    assert ticket["prompt_hash"] == prompt_hash(tokens[:49])
    assert tuple(ticket["block_hashes"]) == block_chain(tokens[:48], BS)  # its 3 whole blocks
    assert len(ticket["block_ids"]) == 4 and free_blocks(decode) == total - 4
    out, _ = step(decode)
    (seal,) = meta(out).saves  # the worker writes the ticket's header at the next step
    assert seal.direct and seal.generation == ticket["generation"]
    assert seal.block_ids == (list(ticket["block_ids"]),)
    assert seal.staging_offset == ticket["staging_offset"]
    host, port = ticket["remote_host"], ticket["remote_port"]
    side_channel.call(host, port, ReleaseRequest(["t1"]), None, 5.0)
    out, _ = step(decode)
    assert meta(out).release_direct == ["t1"]
    step(decode, KVConnectorOutput(finished_sending={"t1"}))
    assert free_blocks(decode) == total
    assert sum(kept) == 1


def test_a_turn_not_asked_for_aborted_or_short_is_not_kept(decode):
    total = free_blocks(decode)
    assert finish_turn(decode, "short", 10, 3) is None  # under a block: not worth a lease
    assert finish_turn(decode, "named only", 40, 3, keep={"turn_id": "s0"}) is None  # not asked
    assert finish_turn(decode, "not asked", 40, 3, keep={"keep_turn": False}) is None
    decode.add_request(make_request("streamed", 40, max_tokens=3))  # no router will take it
    for _ in range(3):
        step(decode)
    assert decode.connector.scheduler.pool.pages_in_use == 0
    decode.add_request(make_request("ab", 40, {"keep_turn": True}, max_tokens=10))
    step(decode)
    decode.finish_requests("ab", RequestStatus.FINISHED_ABORTED)
    assert decode.connector.scheduler.pool.pages_in_use == 0
    assert free_blocks(decode) == total


def test_a_named_turn_s_ticket_is_given_by_its_name_until_it_is_released(decode):
    """A streamed answer carries no ticket: its router asks the decode's side channel."""
    ticket = finish_turn(decode, "t1", 40, 10, keep="s1")
    host, port = ticket["remote_host"], ticket["remote_port"]
    reply = side_channel.call(host, port, TurnRequest("s1"), None, 5.0)
    assert isinstance(reply, TurnReply) and msgspec.to_builtins(reply.ticket) == ticket
    with pytest.raises(ConnectionError, match="no turn kept as 'other'"):
        side_channel.call(host, port, TurnRequest("other"), None, 5.0)
    side_channel.call(host, port, ReleaseRequest(["t1"]), None, 5.0)
    step(decode)
    with pytest.raises(ConnectionError, match="no turn kept as 's1'"):
        side_channel.call(host, port, TurnRequest("s1"), None, 5.0)


# The turn's 49 tokens: its 40-token prompt, then its answer (token 7, 9 times; the 10th
# has no KV yet). (what the next prompt does to them, the whole blocks of 16 that load)
EDITS = [
    ("the same", 49),
    ("the answer's text tokenized otherwise", 32),  # tokens 32..47 hold a changed one
    ("a token edited mid-way", 16),
    ("the first block edited", 0),
    ("the history cut short", 16),
    ("expired", 0),
]


@pytest.mark.parametrize(("edit", "loaded"), EDITS, ids=[e for e, _ in EDITS])
def test_the_next_prefill_loads_the_whole_blocks_its_prompt_shares_with_the_turn(
    decode, prefill, edit, loaded
):
    ticket = finish_turn(decode, "t1", 40, 10)
    history = make_request("x", 40).prompt_token_ids + [7] * 9
    if edit == "the answer's text tokenized otherwise":
        history[44:] = [8, 9]
    elif edit == "a token edited mid-way":
        history[20] += 1
    elif edit == "the first block edited":
        history[3] += 1
    elif edit == "the history cut short":
        history = history[:30]
    elif edit == "expired":  # unsigned here: a router could not have edited a signed one
        ticket["expires_at"] = time.time() - 1
    prompt = history + [300 + i for i in range(20)]  # the user's next question
    req = make_request("p2", len(prompt), {"do_remote_decode": True, "earlier_turn": ticket})
    req.prompt_token_ids[:] = prompt
    req._all_token_ids[:] = prompt
    prefill.add_request(req)
    out, _ = step(prefill)
    if not loaded:  # no load, no load error: the prompt is computed here
        assert meta(out).loads == [] and out.num_scheduled_tokens["p2"] == len(prompt)
        return
    (load,) = meta(out).loads
    assert load.error is None and load.first_token == 0 and load.claimed == loaded
    # The whole ticket goes to the worker (its header binds it all); the load stops at claimed.
    assert load.remote.num_tokens == 49 and load.remote.block_ids == tuple(ticket["block_ids"])
    step(prefill, KVConnectorOutput(finished_recving={"p2"}))
    out, _ = step(prefill)
    assert out.num_scheduled_tokens["p2"] == len(prompt) - loaded  # the rest only


def test_kept_turns_give_way_when_running_requests_need_the_blocks(decode):
    for i in range(7):  # 7 turns of 4 blocks each: 28 of 64 held
        finish_turn(decode, f"t{i}", 40, 10, first=5 + i, keep=f"s{i}")
    pool, evicted = decode.connector.scheduler.pool, counted(decode, "evicted_turns")
    assert all(pool.has(f"t{i}") for i in range(7))
    decode.add_request(make_request("big", 450, max_tokens=50, first=100))
    step(decode, worker_frees=True)  # 29 blocks more: 6 free, under an eighth of the cache
    step(decode, worker_frees=True)  # t0's 4 blocks are back: 10 free, nothing more evicted
    assert not pool.has("t0") and all(pool.has(f"t{i}") for i in range(1, 7))
    assert sum(evicted) == 1
    handle = decode.connector.scheduler._handle
    assert isinstance(handle(TurnRequest("s0")), ErrorReply)  # its name goes with it
    assert isinstance(handle(TurnRequest("s1")), TurnReply)


def test_a_decode_that_keeps_turns_must_produce_too():
    with pytest.raises(ValueError, match="kv_role kv_both"):
        make_scheduler("kv_consumer", BS, REUSE, load_failure_policy="recompute")


def test_a_turn_s_load_that_fails_must_be_recomputed_not_fail_the_request():
    with pytest.raises(ValueError, match="kv_load_failure_policy recompute"):
        make_scheduler("kv_producer", BS, REUSE)


@pytest.mark.parametrize("edit", [{}, {"num_tokens": 17}, {"block_ids": [0, 1, 2, 3]}])
def test_with_a_key_a_turn_s_ticket_is_signed_and_an_edited_one_ignored(monkeypatch, edit):
    monkeypatch.setenv(KEY_ENV, "k" * 32)
    decode = make_scheduler("kv_both", BS, REUSE, engine_id="dec", load_failure_policy="recompute")
    prefill = make_scheduler("kv_producer", BS, REUSE, load_failure_policy="recompute")
    try:
        for sched in (decode, prefill):
            sched.connector.scheduler.set_rank_metadata([rank_meta()])
        ticket = finish_turn(decode, "t1", 40, 10)
        assert ticket is not None and len(ticket["ticket_mac"]) == 64
        prompt = make_request("x", 40).prompt_token_ids + [7] * 10 + [300, 301, 302]
        req = make_request(
            "p2", len(prompt), {"do_remote_decode": True, "earlier_turn": {**ticket, **edit}}
        )
        req.prompt_token_ids[:] = prompt
        req._all_token_ids[:] = prompt
        prefill.add_request(req)
        out, _ = step(prefill)
        loaded = [(load.remote.num_tokens, load.error) for load in meta(out).loads]
        assert loaded == ([] if edit else [(49, None)])
    finally:
        decode.connector.shutdown()
        prefill.connector.shutdown()


def test_a_turn_evicted_in_the_step_it_was_kept_leaves_no_valid_header(decode):
    """A decode short of blocks evicts a kept turn at the step after it was kept, the step
    that would seal its header. Each step's metadata runs on a real worker half: a header
    is never valid over blocks vLLM was told it may free, and no step both seals a turn's
    header and gives up its blocks."""
    args = dict(rank=0, tp=1, total_heads=2, block=BS, layout="vllm_cpu_vec")
    worker = make_worker({**args, "engine": f"ev{os.getpid()}", "extra": REUSE}, seed=3)
    evicted = counted(decode, "evicted_turns")
    try:
        decode.add_request(make_request("big", 880, max_tokens=50, first=100))  # 55 of 64
        decode.add_request(make_request("t1", 40, {"keep_turn": True}, 10))
        sending: set[str] = set()
        ticket = None
        for _ in range(12):
            out, outputs = step(decode, KVConnectorOutput(finished_sending=sending))
            step_meta = meta(out)
            sealed = {s.request_id for s in step_meta.saves if s.generation}
            assert not sealed & set(step_meta.release_direct), "sealed and released at once"
            worker.bind(step_meta)
            worker.wait_for_save()
            worker.bind(None)
            sending = worker.get_finished()[0] or set()
            ticket = ticket or params_of(outputs, "t1")
            if ticket is not None and "t1" in sending:
                assert worker.transport is not None
                at = ticket["staging_offset"]
                header = worker.transport.staging[at : at + HEADER_BYTES]
                assert header_generation(header) == 0, "a live header over freed blocks"
        assert ticket is not None and sum(evicted) == 1  # kept, then evicted under pressure
    finally:
        worker.shutdown()


TICKET_EDITS = {
    "other blocks of the decode's cache": {"block_ids": [0, 1, 2, 3]},
    "more tokens": {"num_tokens": 64},
    "another prompt": {"prompt_hash": "0" * 32},
    "another chain": {"block_hashes": ["0" * 32] * 3},
}


@pytest.mark.parametrize("edit", [{}, *TICKET_EDITS.values()], ids=["as issued", *TICKET_EDITS])
def test_a_turn_s_header_binds_what_its_ticket_names_without_a_key(decode, edit):
    """The header the worker seals commits to the ticket's blocks, tokens and chain: an
    unsigned ticket edited to name anything else fails the read before any KV is copied."""
    args = dict(rank=0, tp=1, total_heads=2, block=BS, layout="vllm_cpu_vec")
    worker = make_worker({**args, "engine": f"bd{os.getpid()}", "extra": REUSE}, seed=3)
    reader = ShmTransport(f"qaic_kv_bd{os.getpid()}r_r0_{random.randrange(1 << 30):x}", 64)
    try:
        ticket = finish_turn(decode, "t1", 40, 10)
        out, _ = step(decode)
        worker.bind(meta(out))  # seals the turn's header
        worker.wait_for_save()
        assert worker.transport is not None
        remote = parse_remote_prefill({**ticket, **edit})
        read = checked_read(reader, worker.transport.endpoint(), remote.staging_offset, 0,
                            remote.generation, binding=ticket_binding(remote))  # fmt: skip
        if not edit:
            with read:
                pass
            return
        with pytest.raises(StaleTicket, match="the kv_transfer_params were edited"), read:
            raise AssertionError("read an edited ticket's KV")
    finally:
        reader.close()
        worker.shutdown()


def test_a_turn_whose_request_id_still_holds_staging_is_not_kept(decode):
    """A repeated request id (vLLM's randomization off, a client's X-Request-Id): this
    kv_both engine staged a prefill as "r1" (vLLM has let the request go; its lease holds),
    then a turn "r1" finishes. The turn is not kept, the engine goes on, and the staged
    KV stays for its decode."""
    decode.add_request(make_request("r1", 40, {"do_remote_decode": True}))
    _, outputs = step(decode)
    staged = params_of(outputs, "r1")
    step(decode, KVConnectorOutput(finished_sending={"r1"}))
    assert finish_turn(decode, "r1", 40, 10, first=9) is None
    pool = decode.connector.scheduler.pool
    assert staged["do_remote_prefill"] is True and pool.has("r1")


def an_image(rid: str, prompt: list[int], params: dict) -> Request:
    """A request whose prompt holds an image's placeholder tokens (its KV is the image's)."""
    init_none_hash(sha256)
    image = MultiModalFeatureSpec(None, "image", "img-hash", PlaceholderRange(offset=2, length=8))
    hasher = get_request_block_hasher(BS, sha256)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    req = Request(rid, list(prompt), greedy, None, mm_features=[image], block_hasher=hasher)
    req.kv_transfer_params = params
    return req


def test_turns_are_neither_kept_nor_loaded_where_token_ids_do_not_prove_the_kv(decode, prefill):
    """A kept turn's ticket proves token ids: an image (changed behind the same URL, it
    keeps its placeholder tokens) or prompt embeddings are not what it proves. Such a turn
    is not kept, and a valid ticket does not load into such a request."""
    init_none_hash(sha256)
    embedded = Request("emb", None, SamplingParams(max_tokens=3, temperature=0.0), None,
                       prompt_embeds=torch.zeros(40, 64),
                       block_hasher=get_request_block_hasher(BS, sha256))  # fmt: skip
    embedded.kv_transfer_params = {"keep_turn": True}
    decode.add_request(embedded)
    for _ in range(4):
        out, outputs = step(decode)
        assert params_of(outputs, "emb") is None
    assert "emb" not in decode.requests  # it finished, and nothing holds its blocks
    ticket = finish_turn(decode, "t1", 40, 10)
    prompt = make_request("x", 40).prompt_token_ids + [7] * 9 + [300, 301]
    req = an_image("p2", prompt, {"do_remote_decode": True, "earlier_turn": ticket})
    assert prefill.connector.get_num_new_matched_tokens(req, 0) == (0, False)
    plain = make_request("p3", len(prompt), {"do_remote_decode": True, "earlier_turn": ticket})
    plain.prompt_token_ids[:] = prompt
    assert prefill.connector.get_num_new_matched_tokens(plain, 0) == (49, True)  # the control
