"""Byte-range copies (native non-temporal stores, or memmove without the extension) and the
ranges `block_ranges` plans for whole blocks of every layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_qaic_connector.kv import stream_copy, token_copies
from vllm_qaic_connector.kv.byte_runs import BlockExtents, block_ranges
from vllm_qaic_connector.kv.token_copies import block_runs, gather_tokens
from vllm_qaic_connector.layout import LAYOUTS, KVGeometry, get_layout

GEO = KVGeometry(num_heads=2, head_size=32, block_size=16, dtype=torch.float16)


def test_the_extension_is_built():
    """`make setup` compiles it; without it every copy is a memmove per range."""
    assert stream_copy.NATIVE, "vllm_qaic_connector.kv._stream_copy was not built (C compiler?)"


@pytest.mark.parametrize("native", [True, False])
def test_ranges_of_any_alignment_and_length_are_copied_exactly(native, monkeypatch):
    if not native:
        monkeypatch.setattr(stream_copy, "_native", None)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, 1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    # more than one group of four, odd starts, lengths around the 16/64-byte and page steps
    starts = [0, 3, 70_001, 200_017, 300_000, 400_005, 500_000, 700_001, 900_000]
    lengths = [0, 1, 15, 63, 65, 4_095, 4_097, 150_001, 1]
    copied = stream_copy.copy_ranges(
        np.array([src.ctypes.data + s for s in starts]),
        np.array([dst.ctypes.data + s for s in starts]),
        np.array(lengths),
    )
    expected = np.zeros_like(src)
    for s, n in zip(starts, lengths, strict=True):
        expected[s : s + n] = src[s : s + n]
    assert np.array_equal(dst, expected) and copied == sum(lengths)


def test_address_arrays_of_different_lengths_and_bad_plans_are_refused():
    one = np.zeros(1, dtype=np.uint64)
    with pytest.raises(ValueError, match="one length"):
        stream_copy.copy_ranges(one, one, np.zeros(2, dtype=np.uint64))
    two = np.zeros(2, dtype=np.uint64)
    rows = stream_copy.BlockRows(1, 1, 64, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="one length"):
        rows.copy(one, two)
    tiles = stream_copy.BlockTiles(1, 8, 8, 2, 0, 16, 2, 0, 2, 16)
    with pytest.raises(ValueError, match="one length"):
        tiles.copy(one, two)
    with pytest.raises(ValueError, match="item 1/2/4/8"):  # 3-byte elements: no such copy
        stream_copy.BlockTiles(1, 8, 8, 3, 0, 24, 3, 0, 3, 24).copy(one, one)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_block_ranges_copy_exactly_the_named_blocks_of_every_layout(kind):
    layout = get_layout(kind)
    src = layout.allocate(12, GEO)
    src.copy_(torch.randn(src.shape, generator=torch.Generator().manual_seed(1)))
    dst = layout.allocate(20, GEO)  # caches of different sizes: K and V planes apart
    src_blocks, dst_blocks = [5, 0, 8, 9, 10, 11, 3], [2, 19, 14, 15, 16, 17, 7]
    runs = block_runs(src_blocks, dst_blocks)  # single blocks and a run of four

    def extents(t: torch.Tensor) -> BlockExtents:
        return BlockExtents.of(t.shape, t.stride(), layout.block_dim)

    if kind == "LHBNC":  # heads outermost: a block is H runs, never copied whole
        with pytest.raises(ValueError, match="has gaps"):
            extents(src)
        return
    frm, to, sizes = block_ranges(extents(src), extents(dst), runs, src.element_size())
    assert len(sizes) == 4 * len(extents(src).planes)  # a range per run and plane
    copied = stream_copy.copy_ranges(frm + src.data_ptr(), to + dst.data_ptr(), sizes)
    assert copied == len(src_blocks) * GEO.bytes_per_block
    s_views, d_views = layout.kv_views(src, GEO), layout.kv_views(dst, GEO)
    for s_view, d_view in zip(s_views, d_views, strict=True):
        assert torch.equal(s_view[src_blocks], d_view[dst_blocks])
        assert not d_view[sorted(set(range(20)) - set(dst_blocks))].any()


def test_blocks_with_gaps_between_them_are_copied_block_by_block():
    """A layer whose block stride is padded: no run spans two blocks."""
    layout = get_layout("vllm_cpu_vec")
    shape = layout.physical_shape(12, GEO)
    elems = GEO.num_heads * GEO.block_size * 2 * GEO.head_size
    padded = torch.randn(12 * (elems + 64), generator=torch.Generator().manual_seed(2)).half()
    src = padded.as_strided(shape, (elems + 64, *layout.allocate(1, GEO).stride()[1:]))
    dst = layout.allocate(12, GEO)
    runs = block_runs([2, 3, 4, 9], [5, 6, 7, 0])  # a run of three, then one
    frm, to, sizes = block_ranges(
        BlockExtents.of(src.shape, src.stride(), 0), BlockExtents.of(dst.shape, dst.stride(), 0),
        runs, 2,
    )  # fmt: skip
    assert len(sizes) == 4  # one range per block on the padded side
    stream_copy.copy_ranges(frm + src.data_ptr(), to + dst.data_ptr(), sizes)
    for s_view, d_view in zip(layout.kv_views(src, GEO), layout.kv_views(dst, GEO), strict=True):
        assert torch.equal(s_view[[2, 3, 4, 9]], d_view[[5, 6, 7, 0]])
        assert not d_view[[1, 2, 3, 4, 8, 9, 10, 11]].any()


PAIRS = [(s, d) for s in sorted(LAYOUTS) for d in sorted(LAYOUTS)]


@pytest.mark.parametrize(("src_kind", "dst_kind"), PAIRS)
def test_copy_tokens_writes_the_same_bytes_natively_as_through_numpy(
    src_kind, dst_kind, monkeypatch
):
    """Re-blocked (32 -> 16), shifted, a head range, shuffled blocks: the native row copies
    and numpy's must leave identical caches; every pair must copy rows natively, and
    vllm_cpu's transposed K against any other layout as native transposes."""
    calls: list[stream_copy.BlockRows] = []
    tiles: list[stream_copy.BlockTiles] = []

    copy_rows, copy_tiles = stream_copy.BlockRows.copy, stream_copy.BlockTiles.copy

    def counted(rows: stream_copy.BlockRows, src: np.ndarray, dst: np.ndarray) -> None:
        calls.append(rows)
        copy_rows(rows, src, dst)

    def counted_tiles(t: stream_copy.BlockTiles, src: np.ndarray, dst: np.ndarray) -> None:
        tiles.append(t)
        copy_tiles(t, src, dst)

    src_geo = KVGeometry(num_heads=4, head_size=64, block_size=32, dtype=torch.float16)
    dst_geo = KVGeometry(num_heads=2, head_size=64, block_size=16, dtype=torch.float16)
    src = get_layout(src_kind).allocate(8, src_geo)
    src.copy_(torch.randn(src.shape, generator=torch.Generator().manual_seed(3)))
    src_blocks, dst_blocks = [6, 1, 3, 7, 0], [11, 2, 3, 4, 5, 9, 0, 1, 13, 8, 14]
    results = []
    for native in (True, False):
        monkeypatch.setattr(token_copies, "NATIVE", native)
        monkeypatch.setattr(stream_copy.BlockRows, "copy", counted)
        monkeypatch.setattr(stream_copy.BlockTiles, "copy", counted_tiles)
        dst = get_layout(dst_kind).allocate(16, dst_geo)
        views = (get_layout(src_kind).kv_views(src, src_geo),
                 get_layout(dst_kind).kv_views(dst, dst_geo))  # fmt: skip
        copy_tokens(views[0], src_blocks, views[1], dst_blocks, 5, 70,
                           token_copies.HeadRange(1, 3, 0), dst_t0=13)  # fmt: skip
        results.append(dst)
    assert torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))
    assert results[0].any()
    # rows of every pair go native (V's at least), none shorter than the floor; a packed
    # side (amx) is copied through canonical blocks, which are not vec's transposed K
    assert calls and all(r.chunk >= token_copies.MIN_ROW_BYTES for r in calls)
    assert bool(tiles) == ((src_kind == "vllm_cpu_vec") != (dst_kind == "vllm_cpu_vec"))


@pytest.mark.parametrize("into_cpu", [False, True])
def test_vllm_cpu_keys_are_transposed_natively_to_and_from_a_slot(into_cpu):
    """Whole 128 x 128 key blocks (the in-cache 8 x 8 transposes) and a partial last block
    (element by element): every token as the reference gather reads it."""
    cpu, slot = get_layout("vllm_cpu_vec"), get_layout("qaic_slot")
    cpu_geo = KVGeometry(num_heads=2, head_size=128, block_size=128, dtype=torch.bfloat16)
    slot_geo = KVGeometry(num_heads=2, head_size=128, block_size=512, dtype=torch.bfloat16)
    n, cpu_blocks = 300, [4, 0, 2]
    gen = torch.Generator().manual_seed(5)
    layers = [cpu.allocate(5, cpu_geo), slot.allocate(2, slot_geo)]
    src_i = 1 if into_cpu else 0
    layers[src_i].view(torch.int16).copy_(
        torch.randint(-(2**15), 2**15, layers[src_i].shape, dtype=torch.int16, generator=gen)
    )
    cpu_kv, slot_kv = cpu.kv_views(layers[0], cpu_geo), slot.kv_views(layers[1], slot_geo)
    if into_cpu:
        copy_tokens(slot_kv, [1], cpu_kv, cpu_blocks, 0, n)
    else:
        copy_tokens(cpu_kv, cpu_blocks, slot_kv, [1], 0, n)
    for want, got in zip(gather_tokens(cpu_kv, cpu_blocks, n), gather_tokens(slot_kv, [1], n),
                         strict=True):  # fmt: skip
        assert torch.equal(want.view(torch.int16), got.view(torch.int16))
        assert want.view(torch.int16).any()


def test_block_ids_outside_the_cache_are_refused_before_a_native_copy():
    geo = KVGeometry(num_heads=2, head_size=128, block_size=16, dtype=torch.float16)
    hnd = get_layout("LBHNC")
    src, dst = hnd.kv_views(hnd.allocate(4, geo), geo), hnd.kv_views(hnd.allocate(4, geo), geo)
    with pytest.raises(IndexError, match="outside 0..3"):
        copy_tokens(src, [0, 1], dst, [2, 4], 0, 32)


from vllm_qaic_connector.kv.token_copies import copy_layers  # noqa: E402


def copy_tokens(src, src_blocks, dst, dst_blocks, t0, t1, heads=None, dst_t0=None):
    return copy_layers([src], src_blocks, [dst], dst_blocks, t0, t1, heads, dst_t0)
