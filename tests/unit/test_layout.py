"""Layouts, canonical views and the copy primitive, against a plain reference."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.worker_processes import vllm_kv_caches
from vllm_qaic_connector.cpu_packing import CPU_PACKINGS, PackedKV
from vllm_qaic_connector.kv.byte_runs import plan_slot_reads
from vllm_qaic_connector.kv.layout_probe import (
    ISA_PACKINGS,
    attention_isa,
    cpu_layout,
    matches_vllm_op,
)
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.kv.token_copies import (
    HeadRange,
    copy_layers,
    gather_tokens,
    plan_token_runs,
)
from vllm_qaic_connector.layout import (
    LAYOUTS,
    VLLM_ORDERS,
    KVGeometry,
    blocks_for_tokens,
    get_layout,
)

HEADS, HEAD = 2, 32


def geo(bs: int, heads: int = HEADS, dtype: torch.dtype = torch.float32) -> KVGeometry:
    return KVGeometry(num_heads=heads, head_size=HEAD, block_size=bs, dtype=dtype)


def filled(kind: str, bs: int, num_blocks: int, heads: int = HEADS, seed: int = 0):
    g = geo(bs, heads)
    layer = get_layout(kind).allocate(num_blocks, g)
    layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(seed)))
    return layer, g


# Where vLLM 0.32's `reshape_and_cache` (csrc/cpu/cpu_attn_*.hpp) puts token t's dim d of
# one (block, head) of B tokens and D dims, written out apart from the `Tiling`s.
def _vllm_index(kind: str, t: int, d: int, b: int, dims: int) -> tuple[int, int]:
    if kind == "vllm_cpu_vec":
        return d * b + t, t * dims + d
    if kind == "vllm_cpu_amx":
        k = (t // 16) * 16 * dims + (d // 2) * 32 + (t % 16) * 2 + d % 2
        return k, (d // 16) * 16 * b + (t // 2) * 32 + (d % 16) * 2 + t % 2
    assert kind == "vllm_cpu_neon_bf16"
    k = (t // 8) * 8 * dims + (d // 4) * 32 + (t % 8) * 4 + d % 4
    return k, (d // 2) * 2 * b + (t // 4) * 8 + (d % 2) * 4 + t % 4


@pytest.mark.parametrize("kind", sorted(CPU_PACKINGS))
@pytest.mark.parametrize("bs", [32, 64])
def test_cpu_packings_read_each_element_where_vllms_kernel_writes_it(kind, bs):
    """Each (block, head) holds its elements' own indices; the layout must read token t's
    dim d from where vLLM's kernel writes it, for every t and d."""
    g = KVGeometry(num_heads=2, head_size=HEAD, block_size=bs, dtype=torch.float32)
    layer = get_layout(kind).allocate(2, g)
    per_plane = bs * HEAD
    layer.view(2, 2, 2, per_plane).copy_(torch.arange(per_plane, dtype=torch.float32))
    k, v = gather_tokens(get_layout(kind).kv_views(layer, g), [1, 0], 2 * bs)
    for t in range(2 * bs):
        for d in range(HEAD):
            want = _vllm_index(kind, t % bs, d, bs, HEAD)
            assert (k[1, t, d].item(), v[0, t, d].item()) == want, (t, d)


def test_cpu_packings_round_trip_through_their_tiles():
    for kind, tilings in CPU_PACKINGS.items():
        canonical = torch.randn(3, 2, 64, HEAD)
        for tiling in tilings:
            assert torch.equal(tiling.unpack(tiling.pack(canonical)), canonical), kind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 32, 128])
@pytest.mark.parametrize("head", [32, 64, 80])
def test_this_hosts_packing_is_proven_by_vllms_own_op(dtype, bs, head):
    """The packing vLLM picks on this host (vec, vec16, amx, ...) is one we know, found by
    writing with vLLM's op; the naive reading (K stored like V) must not pass."""
    g = KVGeometry(num_heads=2, head_size=head, block_size=bs, dtype=dtype)
    isa = attention_isa(g)
    layout = cpu_layout(g)
    assert layout.kind in ISA_PACKINGS[isa], (isa, layout.kind)
    print(f"host ISA {isa}: {dtype} block {bs} head {head} -> {layout.kind}")
    assert not matches_vllm_op("BLHNC", isa, g)  # the probe has teeth


@pytest.mark.parametrize(
    ("dtype", "kind"),
    [(torch.float32, "vllm_cpu_vec"), (torch.float16, "vllm_cpu_vec"),
     (torch.bfloat16, "vllm_cpu_neon_bf16")],
)  # fmt: skip
def test_unverified_neon_caches_are_named_by_their_dtype(monkeypatch, dtype, kind):
    """On ARM vLLM picks `neon` for every dtype; it packs bf16 in BFMMLA's tiles (a build
    with ARM bf16) but float32 and float16 as `vec` (csrc/cpu/cpu_attn_neon.hpp). With
    verify_cpu_layout off, the dtype decides the name."""
    from vllm.platforms import CpuArchEnum
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn.current_platform, "get_cpu_architecture", lambda: CpuArchEnum.ARM)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    g = KVGeometry(num_heads=2, head_size=64, block_size=32, dtype=dtype)
    assert attention_isa(g) == "neon"  # vLLM's own choice on that host
    assert cpu_layout(g, verify=False).kind == kind


def test_fp8_cpu_cache_is_refused_by_name():
    g = KVGeometry(num_heads=2, head_size=HEAD, block_size=32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="fp8 KV cache"):
        cpu_layout(g)


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
    if isinstance(views, PackedKV):  # token-major only once unpacked
        views = tuple(t.unpack(p) for t, p in zip(views.tilings, views, strict=True))
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
    dst_layer, dg = filled("vllm_cpu_vec", 32, 1, heads=3, seed=5)
    sv, dv = (
        get_layout("cuda_nhd").kv_views(src_layer, sg),
        get_layout("vllm_cpu_vec").kv_views(dst_layer, dg),
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
    src_layer, sg = filled("vllm_cpu_vec", 16, 3)
    dst_layer, dg = filled("cuda_hnd", 16, 3, seed=1)
    sv = get_layout("vllm_cpu_vec").kv_views(src_layer, sg)
    dv = get_layout("cuda_hnd").kv_views(dst_layer, dg)
    before = (src_layer.clone(), dst_layer.clone())
    src_ids, dst_ids = ([0, bad], [1, 2]) if side == "source" else ([0, 1], [bad, 2])
    with pytest.raises(IndexError, match=f"block ids {bad}..{bad} outside 0..2"):
        copy_tokens(sv, src_ids, dv, dst_ids, 0, 20)
    assert torch.equal(src_layer, before[0]) and torch.equal(dst_layer, before[1])


def test_staging_format_round_trip_through_flat_bytes():
    fmt = StagingFormat("vllm_cpu_vec", geo(32), num_layers=2)
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
    with pytest.raises(ValueError, match="tokens into slot"):
        plan_slot_reads(KVGeometry(1, 4, 8, torch.float32), 9, 0, [(0, 64)])


@pytest.fixture(scope="module")
def isa_verdicts() -> dict[str, list[str]]:
    """`testbed.cpu_packings` in a subprocess (an ISA's kernel may stop it with SIGILL)."""
    run = subprocess.run([sys.executable, "-m", "testbed.cpu_packings"], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    lines = [x for x in run.stdout.splitlines() if " -> " in x]
    last = lines[-1] if lines else "the start"
    assert run.returncode == 0, f"stopped at {last}: {run.stderr[-2000:]}"
    verdicts: dict[str, list[str]] = {}
    for line in lines:
        case, verdict = line.split(" -> ")
        verdicts.setdefault(case.split()[0], []).append(f"{case}: {verdict}")
    return verdicts


@pytest.mark.parametrize("isa", sorted(ISA_PACKINGS))
def test_every_vllm_cpu_isa_writes_the_packing_we_read(isa, isa_verdicts):
    """Every ISA vLLM's CPU attention can pick, written with vLLM's own op wherever its
    build for this host has the kernel; the rest are named as not checked here (a skip
    with the reason), never passed silently."""
    cases = isa_verdicts[isa]
    assert not [c for c in cases if c.endswith("mismatch")], cases
    if all("cannot run here" in c for c in cases):
        pytest.skip(f"{isa} ({'/'.join(ISA_PACKINGS[isa])}) not checked on this host: {cases[0]}")
    assert all(c.split(": ")[-1] in ISA_PACKINGS[isa] for c in cases), cases


def copy_tokens(src, src_blocks, dst, dst_blocks, t0, t1, heads=None, dst_t0=None):
    return copy_layers([src], src_blocks, [dst], dst_blocks, t0, t1, heads, dst_t0)
