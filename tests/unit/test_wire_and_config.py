"""Handshake encoding/validation, kv_transfer_params parsing, config validation."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import subprocess
import sys
import time

import msgspec
import pytest

from testbed.handshake_ranks import rank_meta
from vllm_qaic_connector.config import parse_config
from vllm_qaic_connector.protocol.names import KV_DTYPES
from vllm_qaic_connector.protocol.side_channel import SideChannelServer, call
from vllm_qaic_connector.protocol.ticket import parse_remote_prefill, ticket_mac, ticket_problem
from vllm_qaic_connector.protocol.wire import (
    CONVERTIBLE_DTYPES,
    PROTOCOL_VERSION,
    HandshakeReply,
    HandshakeRequest,
    Ok,
    ReleaseRequest,
    encode_message,
    incompatibility,
    open_message,
)


def test_handshake_round_trip_with_and_without_key():
    reply = HandshakeReply(PROTOCOL_VERSION, [rank_meta(), rank_meta(tp_rank=1)])
    for key in (None, b"secret"):
        assert _decode(encode_message(reply, key), key) == reply


def test_wrong_key_is_refused():
    frame = encode_message(ReleaseRequest(["r"]), b"right")
    with pytest.raises(ValueError, match="authentication"):
        _decode(frame, b"wrong")


def test_garbage_is_a_clear_error():
    with pytest.raises(ValueError, match="malformed side-channel message"):
        _decode(b"\0" * 32 + b"\x93garbage", None)


@pytest.mark.parametrize(
    "field,value",
    [
        ("dtype", "bfloat16"),
        ("head_size", 64),
        ("num_layers", 3),
        ("num_kv_heads", 8),
    ],
)
def test_incompatible_peer_names_the_field(field, value):
    problem = incompatibility(rank_meta(), rank_meta(**{field: value}))
    assert problem is not None and f"differs in {field}" in problem


@pytest.mark.parametrize("decode_layout", ["qaic_slot", "vllm_cpu_vec", "LBHNC"])
def test_kv_dtypes_differ_only_into_a_qaic_slot_and_only_between_plain_floats(decode_layout):
    """Every pair of the dtypes a handshake may state: a QAIC decode takes another plain
    float (it converts in its slot copy); anything else is refused, naming both dtypes."""
    for ours, theirs in itertools.product(sorted(KV_DTYPES), repeat=2):
        mine, peer = rank_meta(dtype=ours), rank_meta(dtype=theirs, layout_kind=decode_layout)
        problem = incompatibility(mine, peer)
        converts = decode_layout == "qaic_slot" and {ours, theirs} <= CONVERTIBLE_DTYPES
        if ours == theirs or converts:
            assert problem is None, (ours, theirs, problem)
        else:
            assert problem and f"ours={ours!r} theirs={theirs!r}; only a QAIC" in problem


def test_layers_that_differ_name_the_speculative_drafter_as_a_cause():
    """A decode running EAGLE beside a prefill that does not: its drafter's KV layer is one
    more than the prefill's, and the message must say what to change."""
    problem = incompatibility(rank_meta(num_layers=3), rank_meta(num_layers=2))
    assert problem is not None and "--speculative-config" in problem


TARGET = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
DRAFT = tuple(f"draft_model.model.layers.{i}.self_attn.attn" for i in range(2))


@pytest.mark.parametrize(
    ("ours", "theirs", "drafters", "named"),
    [
        # the same layers in another order (a set's order, by hash seed): refused by name
        ((DRAFT[0], TARGET[0], DRAFT[1], TARGET[1]), (TARGET[0], DRAFT[0], DRAFT[1], TARGET[1]),
         ("draft_model:aa", "draft_model:aa"), "its layer 0 is 'model.layers.0.self_attn.attn'"),
        # the same layers, another drafter's weights
        ((*DRAFT, *TARGET), (*DRAFT, *TARGET), ("draft_model:aa", "draft_model:bb"),
         "runs another speculative drafter: ours=draft_model:aa theirs=draft_model:bb"),
        # a peer that does not name its layers (a QAIC decode) is held to the count alone
        ((*DRAFT, *TARGET), (), ("", ""), None),
    ],
)  # fmt: skip
def test_peers_compare_every_kv_layer_by_name_and_the_drafter(ours, theirs, drafters, named):
    mine = rank_meta(num_layers=4, layers=ours, drafter=drafters[0])
    problem = incompatibility(mine, rank_meta(num_layers=4, layers=theirs, drafter=drafters[1]))
    assert problem == named if named is None else named in str(problem)
    assert incompatibility(mine, mine) is None


def test_only_a_drafter_with_kv_of_its_own_is_named_in_the_handshake():
    """vLLM gives an n-gram drafter the target's own model config: it keeps no KV, and a
    decode running it beside a plain prefill must load (CI's DP 2 n-gram harness case
    failed every load when the drafter was named). A draft model is named by its weights."""
    from vllm.config import SpeculativeConfig

    from testbed.shipped_model import MODEL_DIR
    from testbed.vllm_harness import make_vllm_config
    from vllm_qaic_connector.worker.registration import drafter_of, weights_fingerprint

    drafts = {"ngram": {"prompt_lookup_max": 4, "prompt_lookup_min": 2},
              "draft_model": {"model": str(MODEL_DIR)}}  # fmt: skip
    named = {}
    for method, extra in drafts.items():
        cfg = make_vllm_config("kv_consumer")
        cfg.speculative_config = SpeculativeConfig(
            method=method, num_speculative_tokens=2, target_model_config=cfg.model_config,
            target_parallel_config=cfg.parallel_config, **extra,
        )  # fmt: skip
        named[method] = drafter_of(cfg)
    assert named == {"ngram": "", "draft_model": f"draft_model:{weights_fingerprint(cfg)}"}


def test_layer_order_does_not_follow_the_hash_seed():
    """Draft layer i ties with the target's on index: ordered by index alone (as before),
    a set's order decides, and it differs between processes started with other
    PYTHONHASHSEEDs; by index then name, never."""
    code = (
        "from vllm.model_executor.models.utils import extract_layer_index as i\n"
        "from vllm_qaic_connector.kv.kv_groups import in_layer_order\n"
        f"names = set({list(TARGET + DRAFT)!r})\n"
        "print(in_layer_order(names), sorted(names, key=i))"
    )
    seen = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.splitlines()[-1]
        for seed in ("1", "2")
    }  # fmt: skip
    ours, by_index = {x.split("] [")[0] for x in seen}, {x.split("] [")[1] for x in seen}
    assert len(ours) == 1 and len(by_index) > 1, seen


@pytest.mark.parametrize(
    ("ours", "theirs", "shared"),
    [
        (("tiny", "aa"), ("tiny-local-copy", "aa"), True),  # one checkpoint, two paths
        (("tiny", "aa"), ("tiny", "bb"), False),  # other weights under the same name
        (("tiny", "aa"), ("tiny", ""), True),  # no fingerprint there: the names decide
        (("tiny", "aa"), ("other", ""), False),
    ],
)
def test_peers_share_kv_when_their_weights_agree_whatever_their_names(ours, theirs, shared):
    mine = rank_meta(model=ours[0], weights=ours[1])
    problem = incompatibility(mine, rank_meta(model=theirs[0], weights=theirs[1]))
    assert (problem is None) == shared, problem
    if not shared:
        assert "other weights" in problem and repr(theirs[0]) in problem


def test_negotiated_fields_stay_out_of_the_hash():
    other = rank_meta(block_size=64, layout_kind="LBHNC", tp_size=2, tp_rank=1)
    assert incompatibility(rank_meta(), other) is None


def good_params() -> dict:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_host": "127.0.0.1",
        "remote_port": 5555,
        "remote_request_id": "r1",
        "num_tokens": 100,
        "staging_offset": 0,
        "staged_layout": "vllm_cpu_vec",
        "staged_block_size": 128,
        "incarnation": "0123456789abcdef",
        "generation": 7 << 32,
        "prompt_hash": "0" * 32,
        "lease_s": 120.0,
        "expires_at": 1.9e9,
        "extra_field_from_a_newer_proxy": 1,
    }


def test_remote_prefill_params_parse():
    assert parse_remote_prefill(good_params()).num_tokens == 100


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("remote_port", "not-a-port", "remote_port"),
        ("num_tokens", -3, "num_tokens"),
        ("remote_host", None, "remote_host"),
        ("remote_port", -1, "remote_port must be in 1..65535, got -1"),
        ("remote_port", 70000, "remote_port"),
        ("remote_host", "bad host!", "remote_host 'bad host!' is not a host name"),
        ("staged_layout", "weird", "staged_layout 'weird' is unknown"),
        ("staged_block_size", 0, "staged_block_size"),
        ("generation", 0, "generation"),
        ("prompt_hash", "xyz", "prompt_hash"),
        ("lease_s", -1.0, "lease_s"),
        ("block_hashes", ["0" * 32, "XYZ"], "block_hashes must be"),
        ("block_hashes", ["0" * 32] * 2, "at most one 32-hex-digit hash per whole block"),
    ],
)
def test_malformed_params_name_the_field(field, value, msg):
    params = good_params()
    params[field] = value
    with pytest.raises(ValueError, match=msg):
        parse_remote_prefill(params)


def test_missing_param_is_named():
    params = good_params()
    del params["remote_engine_id"]
    with pytest.raises(ValueError, match="remote_engine_id"):
        parse_remote_prefill(params)


def test_config_defaults_and_errors():
    assert parse_config(None).transport == "shm"
    with pytest.raises(ValueError, match="staging_byte"):
        parse_config({"staging_byte": 1})  # a typo is named
    with pytest.raises(ValueError, match="transport"):
        parse_config({"transport": "rdma"})
    with pytest.raises(ValueError, match="staging_page_bytes"):
        parse_config({"staging_page_bytes": 0})
    with pytest.raises(ValueError, match="kv_cache_prefix"):
        parse_config({"kv_cache_prefix": "bad-prefix"})
    with pytest.raises(ValueError, match="staging_bytes"):
        parse_config({"staging_bytes": "lots"})


def test_side_channel_serves_and_authenticates():
    seen = []

    def handler(msg):
        seen.append(msg)
        return Ok()

    server = SideChannelServer("127.0.0.1", 0, handler, b"k")
    try:
        assert call("127.0.0.1", server.port, ReleaseRequest(["a"]), b"k", 5.0) == Ok()
        assert seen == [ReleaseRequest(["a"])]
        with pytest.raises(ConnectionError):  # the server cannot answer a wrong key
            call("127.0.0.1", server.port, HandshakeRequest(1, "x"), b"bad", 1.0)
        assert len(seen) == 1
    finally:
        server.close()


def test_side_channel_peer_down_times_out():
    with pytest.raises(ConnectionError, match="silent"):
        call("127.0.0.1", 1, HandshakeRequest(1, "x"), None, 0.3)


def serde_like(value: object, rng: random.Random) -> object:
    """A JSON value as a router that re-serialises numbers may pass it on: floats one ULP
    off, either way, now and then (vllm-router 0.1.17: 468 of 4,000)."""
    if isinstance(value, dict):
        return {k: serde_like(v, rng) for k, v in value.items()}
    if isinstance(value, float) and rng.random() < 0.5:
        return math.nextafter(value, math.inf if rng.random() < 0.5 else -math.inf)
    return value


def test_a_signed_ticket_survives_a_router_that_rewrites_floats():
    key, rng = b"k" * 32, random.Random(0)
    for i in range(400):
        expires = round(time.time() + 120 + rng.random() * 1000, 3)  # as a prefill issues it
        ticket = parse_remote_prefill({**good_params(), "expires_at": expires, "lease_s": 120.0})
        signed = msgspec.structs.replace(ticket, ticket_mac=ticket_mac(ticket, key))
        routed = json.loads(json.dumps(serde_like(msgspec.to_builtins(signed), rng)))
        assert ticket_problem(parse_remote_prefill(routed), key) is None, i
    # An edit of the expiry by a millisecond still breaks it.
    edited = msgspec.structs.replace(signed, expires_at=signed.expires_at + 0.001)
    assert "does not match" in (ticket_problem(edited, key) or "")


def test_a_signed_ticket_survives_a_router_that_names_the_prefill_s_host():
    """production-stack's router sets ``remote_host`` to the host it reaches the prefill by;
    the engine, its start and the port stay signed (the handshake proves the first two)."""
    key = b"k" * 32
    ticket = parse_remote_prefill({**good_params(), "expires_at": time.time() + 60})
    signed = msgspec.structs.replace(ticket, ticket_mac=ticket_mac(ticket, key))
    routed = msgspec.structs.replace(signed, remote_host="prefill-0.pool.svc")
    assert ticket_problem(routed, key) is None
    for edit in ({"remote_engine_id": "other"}, {"incarnation": "0" * 16}, {"remote_port": 2},
                 {"adapter": "0" * 16}):  # fmt: skip
        edited = msgspec.structs.replace(routed, **edit)  # type: ignore[arg-type]
        assert "does not match" in (ticket_problem(edited, key) or ""), edit


def _decode(frame, key):
    return open_message(frame, key).message
