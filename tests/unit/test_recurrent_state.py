"""Mamba (SSM) layers' recurrent state: vLLM's Mamba group accepted by its spec, the prefill
stopping one token short inside a real vLLM Scheduler, and the state's bytes through a
real POSIX shm segment into another engine's state block."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from testbed.handshake_ranks import rank_meta
from testbed.vllm_harness import (
    MAMBA_SHAPES,
    make_kv_cache_config,
    make_request,
    make_scheduler,
    meta,
    params_of,
    remote_params,
    step,
)
from vllm_qaic_connector.kv.kv_groups import groups_of, state_bytes
from vllm_qaic_connector.kv.recurrent_state import RecurrentState, mamba2_splits, mixer_splits
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.kv.tp_mapping import reads_needed, source_ranks
from vllm_qaic_connector.layout import KVGeometry
from vllm_qaic_connector.protocol.wire import compat_hash
from vllm_qaic_connector.transports.shm import SharedSegment

BS = 16
STATE_BYTES = sum(torch.Size(s).numel() * 4 for s in MAMBA_SHAPES)


def test_a_mamba_group_is_accepted_with_its_state_size_and_other_modes_are_refused():
    config = make_kv_cache_config(BS, mamba=True)
    groups = groups_of(config)
    assert [g.state_bytes for g in groups] == [STATE_BYTES, 0]
    assert state_bytes(groups) == 2 * STATE_BYTES  # two Mamba layers
    spec = config.kv_cache_groups[0].kv_cache_spec
    config.kv_cache_groups[0].kv_cache_spec = dataclasses.replace(spec, mamba_cache_mode="align")
    with pytest.raises(ValueError, match="KV cache group 0 keeps Mamba state in mode 'align'"):
        groups_of(config)


def vllm_like_state(num_blocks: int, seed: int) -> tuple[torch.Tensor, ...]:
    """One layer's conv and SSM state as vLLM lays them out: views into one raw buffer,
    each block a padded page holding both."""
    page = 65536  # elements per block (vLLM pads the page)
    raw = torch.randn(num_blocks * page, generator=torch.Generator().manual_seed(seed))
    conv = raw.as_strided((num_blocks, *MAMBA_SHAPES[0]), (page, MAMBA_SHAPES[0][1], 1))
    at = MAMBA_SHAPES[0][0] * MAMBA_SHAPES[0][1]
    ssm_strides = (page, 64 * 64, 64, 1)
    ssm = raw.as_strided((num_blocks, *MAMBA_SHAPES[1]), ssm_strides, storage_offset=at)
    return conv, ssm


def test_state_crosses_a_real_shm_segment_into_another_engines_block():
    prefill = RecurrentState((vllm_like_state(8, 1), vllm_like_state(8, 2)), (0, 0))
    decode = RecurrentState((vllm_like_state(8, 3), vllm_like_state(8, 4)), (0, 0))
    assert prefill.signature() == decode.signature()
    geo = KVGeometry(2, 32, BS, torch.float32)
    fmt = StagingFormat("vllm_cpu_vec", geo, 2, (), prefill.nbytes())
    n = 37  # KV of 3 blocks per layer, then the state, aligned
    name = f"qaic_kv_test_state_{os.getpid()}"
    own = SharedSegment(name, 1 << 22, create=True)
    try:
        region = own.tensor[: fmt.request_bytes(n)]
        kv_bytes = 2 * 3 * geo.bytes_per_block
        region[:kv_bytes].fill_(7)  # the KV a save wrote just before
        assert prefill.save(([5], [1, 2, 3]), fmt.state_region(region, n)) == 2 * STATE_BYTES
        assert bool((region[:kv_bytes] == 7).all()), "the state overwrote the KV"
        peer = SharedSegment(name, 1 << 22, create=False)  # the decode's read-only mapping
        untouched = [t[2].clone() for layer in decode.layers for t in layer]
        staged = fmt.state_region(peer.tensor[: fmt.request_bytes(n)], n)
        decode.load(staged, ([6], [9, 10, 11]), 1, 0)  # from a prefill of TP 1
        for p_layer, d_layer in zip(prefill.layers, decode.layers, strict=True):
            for p, d in zip(p_layer, d_layer, strict=True):
                assert torch.equal(d[6], p[5])
        after = [t[2] for layer in decode.layers for t in layer]
        assert all(torch.equal(a, b) for a, b in zip(after, untouched, strict=True))
        with pytest.raises(ValueError, match="state region of"):
            decode.load(staged[:-4], ([6], [9]), 1, 0)
        peer.close()
    finally:
        own.close()


def test_the_compat_hash_tells_state_shapes_apart():
    a = RecurrentState((vllm_like_state(2, 1),), (0,)).signature()
    b = (a[0].replace("8x64x64", "4x64x64"),)  # half the heads
    assert compat_hash(2, 2, 32, (), a) != compat_hash(2, 2, 32, (), b)
    assert compat_hash(2, 2, 32, (), a) != compat_hash(2, 2, 32)
    # A state whose split is unknown names the TP size: another TP size is refused.
    tp2 = RecurrentState((vllm_like_state(2, 1),), (0,), tp_size=2).signature()
    assert tp2 != a


# Mamba2 sizes: heads, head_dim, B/C groups, d_state; the conv keeps K - 1 = 3 columns.
H, HD, S, KM1 = 4, 3, 5, 3


def global_state(groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole model's conv channels (x, B, C as [channels, K-1]) and SSM state."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(H * HD, KM1, generator=g)
    bc = torch.randn(2 * groups * S, KM1, generator=g)
    return x, bc, torch.randn(H, HD, S, generator=g)


def shard(state, groups: int, tp: int, rank: int, ds: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's block as vLLM's MambaMixer2 shards it: its heads' x channels, its groups'
    B and C channels (one group everywhere when the model has one), its heads' SSM state."""
    x, bc, ssm = state
    per = H // tp
    mine = [0] if groups == 1 else range(rank * groups // tp, (rank + 1) * groups // tp)
    b = torch.cat([bc[g * S : (g + 1) * S] for g in mine])
    c = torch.cat([bc[(groups + g) * S : (groups + g + 1) * S] for g in mine])
    conv = torch.cat([x[rank * per * HD : (rank + 1) * per * HD], b, c])
    return (conv if ds else conv.T.contiguous()), ssm[rank * per : (rank + 1) * per].clone()


def engine_rank(groups: int, tp: int, rank: int, ds: bool, seed: int) -> RecurrentState:
    """A rank's state tensors (4 blocks, random) with the splits the worker derives."""
    conv, ssm = shard(global_state(groups, seed), groups, tp, rank, ds)
    tensors = (torch.randn(4, *conv.shape), torch.randn(4, *ssm.shape))
    splits = mamba2_splits([conv.shape, ssm.shape], H, HD, groups, S, tp)
    assert splits is not None
    return RecurrentState((tensors,), (0,), (splits,), tp, rank)


TP_PAIRS = [(2, 1), (1, 2), (4, 2), (2, 4), (1, 4), (2, 2)]
# vLLM splits B/C groups evenly over TP, or replicates a single group.
SPLITS = [(g, p, d) for g in (1, 2, 4) for p, d in TP_PAIRS if g == 1 or not (g % p or g % d)]


@pytest.mark.parametrize("ds", [True, False], ids=["DS", "SD"])
@pytest.mark.parametrize("groups,src_tp,dst_tp", SPLITS)
def test_mamba2_state_moves_between_tp_sizes(ds, groups, src_tp, dst_tp):
    """Each prefill rank stages its own shard; each decode rank gathers exactly its
    shard, vLLM's, from the ranks it reads, and nothing else in its cache changes."""
    want = global_state(groups, seed=0)
    prefills = [engine_rank(groups, src_tp, r, ds, 10 + r) for r in range(src_tp)]
    regions = []
    for r, p in enumerate(prefills):
        conv, ssm = shard(want, groups, src_tp, r, ds)
        p.layers[0][0][1].copy_(conv)
        p.layers[0][1][1].copy_(ssm)
        region = torch.empty(p.nbytes(), dtype=torch.uint8)
        assert p.save(([1],), region) == p.nbytes()
        regions.append(region)
    assert len({p.signature() for p in prefills}) == 1
    total_heads = 2  # KV heads: whichever ranks they need, the state's ranks are read
    for d in range(dst_tp):
        decode = engine_rank(groups, dst_tp, d, ds, 20 + d)
        assert decode.signature() == prefills[0].signature()
        before = [t.clone() for t in decode.layers[0]]
        for r in source_ranks(total_heads, src_tp, dst_tp, d, state=True):
            decode.load(regions[r], ([2],), src_tp, r)
        conv, ssm = shard(want, groups, dst_tp, d, ds)
        assert torch.equal(decode.layers[0][0][2], conv)
        assert torch.equal(decode.layers[0][1][2], ssm)
        for t, old in zip(decode.layers[0], before, strict=True):
            keep = [0, 1, 3]
            assert torch.equal(t[keep], old[keep])


def test_shapes_that_are_not_mamba2s_have_no_split():
    conv, ssm = (H * HD + 2 * S, KM1), (H, HD, S)
    assert mamba2_splits([conv, ssm], H, HD, 1, S, 1) is not None
    assert mamba2_splits([conv, (H, HD, S + 1)], H, HD, 1, S, 1) is None
    assert mamba2_splits([(H * HD, KM1), ssm], H, HD, 1, S, 1) is None  # no B, C
    # From a vLLM MambaMixer2's sizes; a mixer without them, or unknown groups: no split.
    mixer = SimpleNamespace(num_heads=H, head_dim=HD, ssm_state_size=S)
    tensors = [torch.empty(2, *conv), torch.empty(2, *ssm)]
    assert mixer_splits(mixer, tensors, 1, 1) == mamba2_splits([conv, ssm], H, HD, 1, S, 1)
    assert mixer_splits(mixer, tensors, None, 1) is None
    assert mixer_splits(SimpleNamespace(), tensors, 1, 1) is None


def test_a_state_read_adds_the_ranks_its_shards_need():
    # One KV head over TP 2 -> 2: decode rank 1 reads the head from prefill rank 0, but
    # its Mamba heads live on prefill rank 1: both are read, and the ack waits for both.
    assert source_ranks(1, 2, 2, 1) == [0]
    assert source_ranks(1, 2, 2, 1, state=True) == [0, 1]
    assert reads_needed(1, 2, 2, state=True) == {(0, 0), (1, 0), (1, 1)}
    assert reads_needed(2, 2, 1, state=True) == {(0, 0), (0, 1)}


def test_prefill_stops_one_token_short_and_stages_the_state_after_the_kv():
    prefill = make_scheduler("kv_producer", BS, {"lease_s": 60.0}, mamba=True)
    prefill.connector.set_xfer_handshake_metadata({})
    prefill.connector.scheduler.set_rank_metadata([rank_meta(block_size=BS)])
    try:
        req = make_request("p1", 100, {"do_remote_decode": True}, max_tokens=5)
        prefill.add_request(req)
        assert req.num_prompt_tokens == 99 and req.max_tokens == 1
        out, outputs = step(prefill)
        (save,) = meta(out).saves
        assert save.num_tokens == 99 and len(save.block_ids[0]) == 1  # one state block
        params = params_of(outputs, "p1")
        assert params is not None and params["num_tokens"] == 99
        plain = make_request("p2", 100, None, max_tokens=5)  # not for a decode: untouched
        prefill.add_request(plain)
        assert plain.num_prompt_tokens == 100
    finally:
        prefill.connector.shutdown()


def test_decode_claims_exactly_the_staged_tokens_and_refuses_a_whole_prompt():
    decode = make_scheduler("kv_consumer", BS, mamba=True, engine_id="dec")
    try:
        decode.add_request(make_request("d1", 100, remote_params(99), max_tokens=2))
        out, _ = step(decode)
        (load,) = meta(out).loads
        assert load.error is None and load.end == 99  # the state is h(99): no fewer
        decode.add_request(make_request("d2", 100, remote_params(100), max_tokens=2))
        out, _ = step(decode)
        (load,) = meta(out).loads
        assert load.error is not None and "stop at least one token short" in load.error
    finally:
        decode.connector.shutdown()
