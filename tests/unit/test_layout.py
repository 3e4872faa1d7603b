"""Layouts, canonical views and the copy primitive, against a plain reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.rank_worker import vllm_kv_caches
from vllm_qaic_connector.kv.byte_runs import ByteRun, merge_runs, plan_slot_reads
from vllm_qaic_connector.kv.layout import (
    LAYOUTS,
    VLLM_ORDERS,
    HeadRange,
    KVGeometry,
    StagingFormat,
    blocks_for_tokens,
    copy_tokens,
    gather_tokens,
    get_layout,
    plan_token_runs,
)
from vllm_qaic_connector.kv.layout_probe import verify_vllm_cpu_layout, write_with_vllm_op

HEADS, HEAD = 2, 32


def geo(bs: int, heads: int = HEADS, dtype: torch.dtype = torch.float32) -> KVGeometry:
    return KVGeometry(num_heads=heads, head_size=HEAD, block_size=bs, dtype=dtype)


def filled(kind: str, bs: int, num_blocks: int, heads: int = HEADS, seed: int = 0):
    g = geo(bs, heads)
    layer = get_layout(kind).allocate(num_blocks, g)
    layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(seed)))
    return layer, g


@pytest.mark.parametrize("bs", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_view_reads_what_vllm_cache_op_wrote(bs, dtype):
    verify_vllm_cpu_layout(bs, HEAD, dtype)  # raises on mismatch
    layout, g = get_layout("vllm_cpu"), geo(bs, dtype=dtype)
    n = 2 * bs + 5
    layer = layout.allocate(4, g)
    key = torch.randn(n, HEADS, HEAD).to(dtype)
    value = torch.randn(n, HEADS, HEAD).to(dtype)
    blocks = [3, 1, 0]
    slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(n)])
    write_with_vllm_op(layer, key, value, slots)
    k, v = gather_tokens(layout.kv_views(layer, g), blocks, n)
    assert torch.equal(k, key.transpose(0, 1)) and torch.equal(v, value.transpose(0, 1))


def test_cpu_view_rejects_natural_k_reading():
    # The naive reading (K stored like V) must NOT match what vLLM wrote: the probe
    # has teeth.
    bs, layout, g = 32, get_layout("vllm_cpu"), geo(32)
    layer = layout.allocate(1, g)
    key = torch.randn(bs, HEADS, HEAD)
    write_with_vllm_op(layer, key, -key, torch.arange(bs))
    naive_k = layer.view(1, HEADS, 2 * bs, HEAD)[0, :, :bs, :]
    assert not torch.equal(naive_k, key.transpose(0, 1))


def test_vllm_layouts_are_vllms_own():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {m.name: m.layer_view_order for m in KVCacheLayout} == VLLM_ORDERS
    assert get_layout("cuda_nhd") is get_layout("NHD") is get_layout("LBNHC")  # vLLM's aliases
    assert get_layout("cuda_hnd") is get_layout("HND") is get_layout("LBHNC")


@pytest.mark.parametrize("kind", sorted(VLLM_ORDERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_vllm_views_read_what_vllms_attention_reads(kind, dtype):
    """Our K and V of the views `create_kv_cache_views` builds are FlashAttention's
    (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``), and a staged layer laid out by
    `from_bytes` has the strides vLLM gives that layout's layers."""
    g = KVGeometry(num_heads=4, head_size=HEAD, block_size=16, dtype=dtype)
    views = vllm_kv_caches(kind, g, 3, 5, torch.Generator().manual_seed(0))
    layout = get_layout(kind)
    for view in views:
        k, v = layout.kv_views(view, g)
        fa_k, fa_v = view.transpose(1, 2).split(HEAD, dim=-1)  # [blocks, tokens, heads, D]
        assert k.data_ptr() == view.data_ptr()  # a view, not a copy
        assert torch.equal(k.view(torch.uint8), fa_k.transpose(1, 2).view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), fa_v.transpose(1, 2).view(torch.uint8))
    staged = layout.from_bytes(torch.zeros(5 * g.bytes_per_block, dtype=torch.uint8), 5, g)
    if kind.startswith("L"):  # layer-compact: a layer alone is laid out as in vLLM
        assert staged.stride() == views[0].stride()
    assert staged.shape == views[0].shape


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_gather_tokens_reads_token_by_token(kind):
    layer, g = filled(kind, 16, 5)
    views, blocks = get_layout(kind).kv_views(layer, g), [3, 0, 4, 1]
    for view, got in zip(views, gather_tokens(views, blocks, 50), strict=True):
        want = torch.stack([view[blocks[t // 16], :, t % 16] for t in range(50)], dim=1)
        assert torch.equal(got, want)
    assert gather_tokens(views, blocks, 0)[0].shape == (HEADS, 0, HEAD)


@given(
    t0=st.integers(0, 300),
    n=st.integers(0, 300),
    s=st.sampled_from([16, 32, 64, 128, 512]),
    d=st.sampled_from([16, 32, 64, 128, 512]),
)
def test_runs_tile_the_range_without_crossing_blocks(t0, n, s, d):
    runs = plan_token_runs(t0, t0 + n, s, d)
    assert int(runs[:, 4].sum()) == n and bool((runs[:, 4] > 0).all())
    pos = t0
    for sb, db, so, do, length in runs.tolist():
        assert sb * s + so == pos == db * d + do
        assert so + length <= s and do + length <= d
        pos += length


BLOCKS = [16, 32, 64, 128, 512]


@settings(max_examples=150, deadline=None)
@given(
    src_kind=st.sampled_from(sorted(LAYOUTS)),
    dst_kind=st.sampled_from(sorted(LAYOUTS)),
    sb=st.sampled_from(BLOCKS),
    db=st.sampled_from(BLOCKS),
    n=st.integers(1, 520),
    skip=st.integers(0, 3),
    data=st.data(),
)
def test_copy_matches_reference_for_every_layout_and_block_pair(
    src_kind, dst_kind, sb, db, n, skip, data
):
    src_nb, dst_nb = blocks_for_tokens(n, sb), blocks_for_tokens(n, db)
    src_layer, sg = filled(src_kind, sb, src_nb + 1, seed=1)
    dst_layer, dg = filled(dst_kind, db, dst_nb + 2, seed=2)
    # Shuffled, or in order like a staged region's (then copies go without a temporary).
    src_blocks = data.draw(st.permutations(range(src_nb + 1)) | st.just(range(1, src_nb + 1)))
    dst_blocks = data.draw(st.permutations(range(dst_nb + 2)) | st.just(range(2, dst_nb + 2)))
    src_blocks, dst_blocks = list(src_blocks)[:src_nb], list(dst_blocks)[:dst_nb]
    t0 = min(n, skip * db)  # a decode-side prefix hit covers whole blocks
    src_views = get_layout(src_kind).kv_views(src_layer, sg)
    dst_views = get_layout(dst_kind).kv_views(dst_layer, dg)
    before = gather_tokens(dst_views, dst_blocks, n)
    untouched = set(range(dst_nb + 2)) - set(dst_blocks)
    other_before = {b: (dst_views[0][b].clone(), dst_views[1][b].clone()) for b in untouched}
    copy_tokens(src_views, src_blocks, dst_views, dst_blocks, t0, n)
    got = gather_tokens(dst_views, dst_blocks, n)
    want = gather_tokens(src_views, src_blocks, n)
    for g_, w_, b_ in zip(got, want, before, strict=False):
        assert torch.equal(g_[:, t0:], w_[:, t0:])
        assert torch.equal(g_[:, :t0], b_[:, :t0])  # the prefix is left alone
    for b, (k, v) in other_before.items():
        assert torch.equal(dst_views[0][b], k) and torch.equal(dst_views[1][b], v)


@pytest.mark.parametrize("heads", [HeadRange(0, 1, 0), HeadRange(1, 2, 0), HeadRange(2, 4, 1)])
def test_head_ranges_select_and_place_heads(heads):
    src_layer, sg = filled("cuda_nhd", 16, 2, heads=4)
    dst_layer, dg = filled("vllm_cpu", 32, 1, heads=3, seed=5)
    sv, dv = (
        get_layout("cuda_nhd").kv_views(src_layer, sg),
        get_layout("vllm_cpu").kv_views(dst_layer, dg),
    )
    copy_tokens(sv, [1, 0], dv, [0], 0, 20, heads)
    want, got = gather_tokens(sv, [1, 0], 20), gather_tokens(dv, [0], 20)
    nh = heads.stop - heads.start
    for w, g_ in zip(want, got, strict=False):
        assert torch.equal(g_[heads.dst_start : heads.dst_start + nh], w[heads.start : heads.stop])


def test_head_range_that_does_not_fit_is_refused():
    src_layer, sg = filled("cuda_nhd", 16, 1, heads=4)
    dst_layer, dg = filled("cuda_nhd", 16, 1, heads=2)
    with pytest.raises(ValueError, match="head range"):
        copy_tokens(
            get_layout("cuda_nhd").kv_views(src_layer, sg),
            [0],
            get_layout("cuda_nhd").kv_views(dst_layer, dg),
            [0],
            0,
            4,
            HeadRange(0, 4),
        )


@pytest.mark.parametrize("side", ["source", "destination"])
@pytest.mark.parametrize("bad", [-1, 3])
def test_block_ids_outside_the_cache_are_refused_before_any_byte_moves(side, bad):
    """Copies go by address: a block id past either cache's end (or negative) is an
    IndexError naming the range, and neither side is written."""
    src_layer, sg = filled("vllm_cpu", 16, 3)
    dst_layer, dg = filled("cuda_hnd", 16, 3, seed=1)
    sv = get_layout("vllm_cpu").kv_views(src_layer, sg)
    dv = get_layout("cuda_hnd").kv_views(dst_layer, dg)
    before = (src_layer.clone(), dst_layer.clone())
    src_ids, dst_ids = ([0, bad], [1, 2]) if side == "source" else ([0, 1], [bad, 2])
    with pytest.raises(IndexError, match=f"block ids {bad}..{bad} outside 0..2"):
        copy_tokens(sv, src_ids, dv, dst_ids, 0, 20)
    assert torch.equal(src_layer, before[0]) and torch.equal(dst_layer, before[1])


def test_staging_format_round_trip_through_flat_bytes():
    fmt = StagingFormat("vllm_cpu", geo(32), num_layers=2)
    region = torch.zeros(fmt.request_bytes(70), dtype=torch.uint8)
    views = fmt.layer_views(region, 70)
    assert len(views) == 2 and views[0][0].shape == (3, HEADS, 32, HEAD)
    views[1][1][2, 1, 5, 7] = 3.5  # layer 1, V, block 2
    again = fmt.layer_views(region, 70)
    assert again[1][1][2, 1, 5, 7] == 3.5 and region.view(torch.float32).count_nonzero() == 1


def test_unknown_layout_is_named():
    with pytest.raises(ValueError, match="unknown KV layout 'bogus'"):
        get_layout("bogus")


# --- byte plans: reads straight into QAIC slots -------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    ctx=st.integers(1, 9),
    slots=st.integers(1, 3),
    data=st.data(),
)
def test_slot_read_plan_moves_exactly_the_staged_tokens_into_one_slot(
    layers, heads, ctx, slots, data
):
    """Apply the plan as raw byte copies: slot k of every K/V buffer gets tokens [0, n) of
    the staged request, nothing else changes, and runs merge wherever both sides continue."""
    n = data.draw(st.integers(1, ctx))
    slot = data.draw(st.integers(0, slots - 1))
    geo = KVGeometry(heads, 4, ctx, torch.int32)
    fmt = StagingFormat("qaic_slot", geo, layers)
    region = torch.randint(0, 256, (fmt.request_bytes(n),), dtype=torch.uint8)
    buf_bytes = slots * heads * ctx * 4 * 4
    gap = buf_bytes + 64  # buffers apart, as separate allocations are: no merging across them
    memory = torch.full((2 * layers * gap,), 0xEE, dtype=torch.uint8)  # "address" 0..
    bases = [(2 * i * gap, (2 * i + 1) * gap) for i in range(layers)]
    runs = plan_slot_reads(geo, n, slot, bases)
    for r in runs:
        memory[r.dst : r.dst + r.nbytes] = region[r.src : r.src + r.nbytes]
    before = torch.full_like(memory, 0xEE).view(torch.int32)
    typed = memory.view(torch.int32)
    for (k_src, v_src), pair in zip(fmt.layer_views(region, n), bases, strict=True):
        for src, base in zip((k_src, v_src), pair, strict=True):
            lo = base // 4
            buf = typed[lo : lo + buf_bytes // 4].view(slots, heads, ctx, 4)
            old = before[lo : lo + buf_bytes // 4].view(slots, heads, ctx, 4)
            assert torch.equal(buf[slot, :, :n], src[0, :, :n])
            assert torch.equal(buf[slot, :, n:], old[slot, :, n:])
            others = [s for s in range(slots) if s != slot]
            assert torch.equal(buf[others], old[others])
    per_buffer = 1 if n == ctx else heads  # all heads are one run when the slot is full
    assert len(runs) == layers * 2 * per_buffer
    assert sum(r.nbytes for r in runs) == layers * 2 * heads * n * 16


def test_merge_runs_joins_only_runs_that_continue_on_both_sides():
    runs = [ByteRun(0, 100, 8), ByteRun(8, 108, 8), ByteRun(16, 200, 8), ByteRun(30, 208, 2)]
    assert merge_runs(runs) == [ByteRun(0, 100, 16), ByteRun(16, 200, 8), ByteRun(30, 208, 2)]
    with pytest.raises(ValueError, match="tokens into slot"):
        plan_slot_reads(KVGeometry(1, 4, 8, torch.float32), 9, 0, [(0, 64)])
