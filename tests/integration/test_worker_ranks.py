"""Prefill and decode worker halves, one real WorkerSide per TP rank, each in its own
process, moving bytes over real shared memory. The handshake is served by a real side
channel in the test process (the role the prefill's scheduler half plays)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from testbed.worker_processes import HEAD, LAYERS, VLLM_PAIRS, full_heads, make_worker, run_handoff
from vllm_qaic_connector.kv.kv_groups import kept_start
from vllm_qaic_connector.kv.tp_mapping import heads_of_rank
from vllm_qaic_connector.protocol.peers import PeerDirectory, check_ranks
from vllm_qaic_connector.protocol.side_channel import SideChannelServer
from vllm_qaic_connector.protocol.wire import (
    PROTOCOL_VERSION,
    HandshakeReply,
    RankMetadata,
    TransportEndpoint,
)
from vllm_qaic_connector.transports import staging_name
from vllm_qaic_connector.transports.shm import SHM_DIR

CPU = "vllm_cpu_vec"  # vLLM CPU's packing on AVX hosts (vec)
CASES = [
    # heads, P TP, D TP, P layout, P block, D layout, D block, tokens, saves off the step
    (4, 2, 1, CPU, 32, "LBNHC", 16, 150, True),
    (4, 4, 2, "LBHNC", 16, CPU, 64, 97, True),
    (2, 4, 1, CPU, 64, CPU, 32, 130, False),  # GQA: heads replicated over prefill
    (4, 1, 2, "LBNHC", 128, "qaic_slot", 256, 200, True),
    (4, 2, 1, "vllm_cpu_amx", 32, CPU, 64, 150, True),  # an AMX host to an AVX one
    (4, 1, 2, CPU, 64, "vllm_cpu_amx", 32, 97, False),
    # MLA: one latent per token, the same on every rank: read once, re-blocked
    (1, 2, 1, "mla_latent", 16, "mla_latent", 64, 150, True),
    (1, 1, 2, "mla_latent", 16, "mla_latent", 16, 97, False),
]


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: f"H{c[0]}-P{c[1]}{c[3]}{c[4]}-D{c[2]}{c[5]}{c[6]}{'' if c[8] else '-sync'}",
)
def test_tp_handoff_bytes_match(case):
    total, p_tp, d_tp, p_layout, p_block, d_layout, d_block, n, async_saves = case
    results, outs, released = run_handoff(
        total, p_tp, d_tp, p_layout, p_block, d_layout, d_block, n, async_saves=async_saves
    )
    assert all(r["unchanged"] for r in results), "saving modified the prefill's KV cache"
    for d_rank, out in enumerate(outs):
        assert out["done"] == {"d1"} and out["errors"] == set()
        mine = heads_of_rank(total, d_tp, d_rank)
        for layer in range(2):
            for kv in range(2):
                want = full_heads(results, total, p_tp, layer, kv)[mine.start : mine.stop]
                assert np.array_equal(out["got"][layer][kv], want)
        # Each head once: a head replicated over prefill ranks is not read twice.
        assert out["stats"]["bytes_copied"] == 2 * LAYERS * n * len(mine) * HEAD * 4
    assert released.count("r1") == d_tp  # every decode rank acknowledged


@pytest.mark.parametrize("pair", VLLM_PAIRS, ids=lambda c: f"{c[0]}{c[3]}-to-{c[1]}{c[4]}-{c[2]}")
def test_vllm_layouts_move_byte_exactly_between_every_pair(pair):
    """Caches built by vLLM's own `create_kv_cache_views` for each of its six layouts,
    registered through the real worker half (prefill TP 2, decode TP 1), moved over shm."""
    src, dst, dtype, p_block, d_block = pair
    results, outs, _ = run_handoff(4, 1, 1, src, p_block, dst, d_block, 97, dtype=dtype)
    assert all(r["unchanged"] and r["meta"].layout_kind == src for r in results)
    [out] = outs
    assert out["done"] == {"d1"} and out["errors"] == set()
    for layer in range(2):
        for kv in range(2):
            assert np.array_equal(out["got"][layer][kv], full_heads(results, 4, 1, layer, kv))


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_an_idle_step_reports_its_load_at_once(transport):
    """Where the engine computes nothing, the load started in a step (its handshake too)
    is reported by that step's get_finished: the request runs one engine step sooner."""
    results, outs, _ = run_handoff(4, 1, 1, CPU, 32, CPU, 32, 100,
                                   transport=transport, idle=True)  # fmt: skip
    assert outs[0]["first"] == {"d1"} and outs[0]["errors"] == set()
    assert np.array_equal(outs[0]["got"][1][0], results[0]["ref"][1][0])


def test_a_load_in_the_step_is_in_place_when_start_load_kv_returns():
    """A shm load the scheduler ran in the step (load_async=False): start_load_kv returns
    with the KV in the blocks (its handshake included), before the step's forward pass,
    and get_finished never reports it (vLLM runs the request already); the prefill is
    acknowledged as for any load."""
    results, outs, released = run_handoff(4, 1, 1, CPU, 32, CPU, 32, 100, in_step=True)
    out = outs[0]
    assert out["done"] is None and out["errors"] == set()
    assert out["stats"]["loaded_requests"] == 1
    for layer in range(2):
        for kv in range(2):
            assert np.array_equal(out["at_return"][layer][kv], results[0]["ref"][layer][kv])
    assert released == ["r1"]


def test_decode_prefix_hit_reads_only_missing_tokens():
    results, outs, _ = run_handoff(4, 1, 1, CPU, 32, CPU, 32, 100, first_token=64)
    out = outs[0]
    for layer in range(2):
        for kv in range(2):
            want = results[0]["ref"][layer][kv]
            got = out["got"][layer][kv]
            assert np.array_equal(got[:, 64:], want[:, 64:])
            assert np.array_equal(got[:, :64], out["prefix_before"][layer][kv])  # untouched
    assert out["stats"]["loaded_tokens"] == 36


def test_incompatible_peer_is_refused_and_blocks_reported():
    _, outs, released = run_handoff(4, 1, 1, CPU, 32, CPU, 32, 70, d_head_size=64)
    out = outs[0]
    assert out["done"] == {"d1"}  # finished, so vLLM applies kv_load_failure_policy
    assert out["errors"] == {3, 4, 5}  # every block it was to load
    assert out["stats"].get("load_failures") == 1
    assert released == ["r1"]  # the prefill's staging is not stranded


@pytest.mark.nixl
def test_nixl_handoff_acknowledged_by_notification():
    """Over NIXL the decode's READ carries its acknowledgement; no side-channel release."""
    results, outs, acks = run_handoff(4, 2, 1, CPU, 32, "LBNHC", 16, 150, transport="nixl")
    out = outs[0]
    assert out["done"] == {"d1"} and out["errors"] == set()
    for layer in range(2):
        for kv in range(2):
            assert np.array_equal(out["got"][layer][kv], full_heads(results, 4, 2, layer, kv))
    assert acks == ["r1@0/1"]  # from both prefill ranks' agents, one reader rank


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_ticket_of_another_generation_is_a_load_error(transport):
    """The staged region's header holds another generation (the region was reused): the
    load fails and reports its blocks, whatever the transport."""
    _, outs, released = run_handoff(4, 1, 1, CPU, 32, CPU, 32, 70, transport=transport, stale=1)
    out = outs[0]
    assert out["done"] == {"d1"} and out["errors"] == {3, 4, 5}
    assert out["stats"].get("load_failures") == 1
    assert "r1" in released  # given up over the side channel: the prefill frees it


# An unsigned ticket edited by whoever carries it (over a transport each).
EDITED = [("shm", {"num_tokens": 100}), ("nixl", {"prompt_hash": "1" * 32}),
          ("shm", {"group_starts": (32,)})]  # fmt: skip


@pytest.mark.parametrize(("transport", "edit"), EDITED, ids=[str(e) for _, e in EDITED])
def test_a_ticket_edited_to_name_other_kv_is_refused_by_the_header(transport, edit):
    """The header binds the tokens, prompt and format the prefill sealed the region for: a
    ticket that names more tokens (bytes past the region: the next request's) or another
    prompt is a load error before anything is copied, with no key on either side."""
    _, outs, released = run_handoff(4, 1, 1, CPU, 32, CPU, 32, 70, transport=transport,
                                    edited=edit)  # fmt: skip
    assert outs[0]["done"] == {"d1"} and outs[0]["errors"] == {3, 4, 5}
    assert outs[0]["stats"].get("load_failures") == 1
    assert outs[0]["stats"].get("loaded_requests") is None


def test_a_read_after_the_lease_ran_out_is_a_load_error():
    """The region still holds the ticket's generation (an idle prefill has not yet freed
    it), but the lease the decode knows of has ended: the read never starts."""
    _, outs, _ = run_handoff(4, 1, 1, CPU, 32, CPU, 32, 70, holds_until=time.time() - 1.0)
    assert outs[0]["done"] == {"d1"} and outs[0]["errors"] == {3, 4, 5}
    assert outs[0]["stats"].get("load_failures") == 1


# --- segment names: unguessable, private, and only ever the peer's own -----------------------

ENGINE = f"nm{os.getpid()}"


@pytest.fixture
def twins() -> Iterator[list]:
    """Two real shm workers of the same engine and rank, made under umask 0."""
    made = []
    old = os.umask(0)  # so a 0600 segment is the connector's doing, not the umask's
    try:
        for seed in range(2):
            args = {"engine": ENGINE, "rank": 0, "tp": 1, "total_heads": 2, "block": 16}
            extra = {"transport": "shm", "staging_bytes": 1 << 20}
            made.append(make_worker({**args, "layout": "LBNHC", "extra": extra}, seed))
    finally:
        os.umask(old)
    yield made
    for w in made:
        w.shutdown()


def test_segments_are_private_and_named_by_a_random_incarnation(twins):
    names = [w.transport.endpoint().address for w in twins]
    assert names[0] != names[1]  # same engine and rank: only the random part tells them apart
    for w, name in zip(twins, names, strict=True):
        assert name == staging_name(ENGINE, 0, w.incarnation)
        assert len(w.incarnation) == 16 and int(w.incarnation, 16) >= 0
        mode = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False).st_mode
        assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600, oct(mode)
        assert check_ranks([w.rank_meta]) is None


def _with_address(r: RankMetadata, address: str, kind: str = "shm") -> RankMetadata:
    return msgspec.structs.replace(r, endpoint=TransportEndpoint(kind, address, 1 << 20))


@pytest.mark.parametrize("target", ["twin", "other_engine", "path"])
def test_handshake_naming_a_segment_not_its_own_is_refused(twins, target):
    """A peer cannot make us map another segment: a live sibling's, another engine's, or a
    path, over a real side channel."""
    me, twin = twins[0].rank_meta, twins[1].rank_meta
    address = {
        "twin": twin.endpoint.address,
        "other_engine": staging_name("victim", 0, me.incarnation),
        "path": "../etc",
    }[target]
    lie = _with_address(me, address)
    server = SideChannelServer(
        "127.0.0.1", 0, lambda msg: HandshakeReply(PROTOCOL_VERSION, [lie]), None
    )
    directory = PeerDirectory("dec", None, 10.0)
    try:
        with pytest.raises(ConnectionError, match="bad handshake reply") as refused:
            directory.get("127.0.0.1", server.port)
        assert directory.answered("127.0.0.1", server.port)  # it replied; we refused it
    finally:
        server.close()
    want = f"rank 0 endpoint.address {address!r} is not the name its handshake implies"
    assert want in str(refused.value) and me.endpoint.address in str(refused.value)


def test_check_ranks_names_unsafe_engine_ids_incarnations_and_nixl_agents(twins):
    me = twins[0].rank_meta
    own = me.endpoint.address
    bad = {
        "engine_id 'a/b' is not a safe name": msgspec.structs.replace(me, engine_id="a/b"),
        "engine_id 'a\\x00' is not a safe name": msgspec.structs.replace(me, engine_id="a\0"),
        "is not a safe name": msgspec.structs.replace(me, engine_id="e" * 129),
        "incarnation 'inc0' is not 16": msgspec.structs.replace(me, incarnation="inc0"),
        "incarnation 'FEEDFACEFEEDFACE' is not 16": msgspec.structs.replace(
            me, incarnation="FEEDFACEFEEDFACE"
        ),
        "endpoint.address 'x@nope' is not name[@0xbase]": _with_address(me, "x@nope", "nixl"),
        "endpoint.address 'nope' is not the name": _with_address(me, "nope", "nixl"),
        f"is not the name its handshake implies ({own!r})": _with_address(
            me, f"{staging_name('victim', 0, me.incarnation)}@0x1000", "nixl"
        ),
    }
    for why, r in bad.items():
        problem = check_ranks([r])
        assert problem is not None and why in problem, (why, problem)
    assert check_ranks([_with_address(me, f"{own}@0x1000", "nixl")]) is None


@pytest.mark.parametrize("nixl_direct_reads", [False, True])
def test_nixl_worker_registers_only_its_staging_never_the_kv_caches(nixl_direct_reads):
    """Issue #10.3: by default nothing reads the KV caches remotely, so they are not NIXL
    memory; a peer's handshake reply (the agent metadata) reaches the staging pool and
    nothing else. ``nixl_direct_reads`` opts in: then the one allocation behind every
    layer is registered too, and the handshake says so."""
    import nixl  # noqa: F401  (NIXL missing is a failure, never a skip)

    args = {"engine": f"reg{os.getpid()}", "rank": 0, "tp": 1, "total_heads": 2, "block": 16}
    extra = {"transport": "nixl", "staging_bytes": 1 << 20, "nixl_direct_reads": nixl_direct_reads}
    w = make_worker({**args, "layout": "LBNHC", "extra": extra}, 0)
    try:
        transport = w.transport
        staging = transport.staging
        # (address, length, device id, meta) per registered range
        registered = [reg[i][:2] for reg in transport._regs for i in range(reg.descCount())]
        storage = w.layers[0][0].untyped_storage()
        cache = (storage.data_ptr(), storage.nbytes())
        expected = [(staging.data_ptr(), staging.numel())] + [cache] * nixl_direct_reads
        assert registered == expected, registered
        assert (w.rank_meta.cache is not None) == nixl_direct_reads
        if w.rank_meta.cache is not None:  # host memory: its READs are DRAM descriptors
            assert w.rank_meta.cache.device == -1
        if not nixl_direct_reads:
            for t in (t for kv in w.layers for t in kv):
                lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
                assert not any(s < hi and lo < s + n for s, n in registered), (
                    "a KV cache is exposed"
                )
    finally:
        w.shutdown()


@pytest.mark.parametrize(
    "case",
    [
        # heads, P TP, D TP, P layout, P block, D layout, D block, tokens, window, transport,
        # first token the decode computes itself (a local prefix-cache hit)
        (4, 2, 1, CPU, 32, "LBNHC", 16, 150, 40, "shm", 0),
        (4, 1, 2, CPU, 64, CPU, 32, 190, 50, "nixl", 0),
        (4, 1, 1, CPU, 32, CPU, 32, 200, 64, "shm", 160),
    ],
    ids=["shm-P2x32-D1x16", "nixl-P1x64-D2x32", "shm-prefix-hit-past-window-start"],
)
def test_hybrid_groups_move_the_windows_tail_and_the_whole_prompt(case):
    """Layer 0 is sliding-window, layer 1 full attention, each group with its own block table
    on both sides; block sizes and TP differ. Only the window's blocks of layer 0 move."""
    total, p_tp, d_tp, p_layout, p_block, d_layout, d_block, n, window, transport, first = case
    results, outs, released = run_handoff(
        total, p_tp, d_tp, p_layout, p_block, d_layout, d_block, n, transport=transport,
        window=window, first_token=first,
    )  # fmt: skip
    claimed = n - 1  # the decode recomputes the last prompt token
    start = max(kept_start(claimed, window, d_block), first)
    assert kept_start(claimed, window, d_block) > 0  # the case has blocks outside the window
    for d_rank, out in enumerate(outs):
        assert out["done"] == {"d1"} and out["errors"] == set()
        assert out["null_untouched"], "a load wrote into vLLM's null block"
        mine = heads_of_rank(total, d_tp, d_rank)
        for kv in range(2):
            full = full_heads(results, total, p_tp, 1, kv)[mine.start : mine.stop]
            assert np.array_equal(out["got"][1][kv][:, first:claimed], full[:, first:claimed])
            assert np.array_equal(out["got"][1][kv][:, :first], out["prefix_before"][1][kv])
            tail = full_heads(results, total, p_tp, 0, kv)[mine.start : mine.stop]
            assert np.array_equal(out["got"][0][kv][:, start:claimed], tail[:, start:claimed])
        per_token = 2 * len(mine) * HEAD * 4
        assert out["stats"]["bytes_copied"] == per_token * (claimed - first + claimed - start)
    assert [r.split("@")[0] for r in released] == ["r1"] * d_tp  # over NIXL: "r1@rank/tp"
