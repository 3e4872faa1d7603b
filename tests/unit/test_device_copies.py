"""The GPU copy path's plan, checked on the CPU: `mirrored_copy` mirrors the host side
into a separate buffer (on a GPU: device memory), converts there and writes back. Whatever
the layouts, a chunk that starts inside a block, a TP head shard or the piece size, it must
leave exactly the bytes `copy_layers` leaves, around the copied tokens too."""

from __future__ import annotations

import pytest
import torch

from vllm_qaic_connector.kv import device_copies
from vllm_qaic_connector.kv.device_copies import mirrored_copy
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.kv.token_copies import HeadRange, copy_layers
from vllm_qaic_connector.layout import KVGeometry, blocks_for_tokens, get_layout

LAYERS, HEADS, HEAD_DIM, N = 3, 4, 8, 45
CPU = torch.device("cpu")


def random_cache(kind: str, block: int, gen: torch.Generator) -> tuple[list, list[int]]:
    geo, layout = KVGeometry(HEADS, HEAD_DIM, block, torch.float16), get_layout(kind)
    nb = blocks_for_tokens(N, block) + 3
    layers = [layout.allocate(nb, geo) for _ in range(LAYERS)]
    for t in layers:
        t.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, t.shape, generator=gen))
    return [layout.kv_views(t, geo) for t in layers], torch.randperm(nb, generator=gen).tolist()


def random_region(kind: str, block: int, gen: torch.Generator) -> tuple[torch.Tensor, list]:
    fmt = StagingFormat(kind, KVGeometry(HEADS, HEAD_DIM, block, torch.float16), LAYERS)
    region = torch.randint(0, 256, (fmt.request_bytes(N) + 64,), dtype=torch.uint8, generator=gen)
    return region, fmt.layer_views(region[64:], N)


CASES = [  # cache layout, its block, staged layout, its block, tokens [t0, t1), pieces
    ("LBNHC", 16, "LBHNC", 16, 0, N, 1),
    ("LBHNC", 8, "LHBNC", 16, 0, N, 1),  # a head-major staging: its spans hold other blocks
    ("BLNHC", 16, "qaic_slot", 64, 0, N, 2),  # K and V apart; two layers a piece
    ("vllm_cpu_vec", 16, "LBNHC", 16, 20, N, 1),  # a second chunk, starting inside a block
    ("LHBNC", 32, "BHLNC", 8, 7, 30, 3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{c[1]}-{c[2]}{c[3]}-{c[4]}:{c[5]}")
@pytest.mark.parametrize("saving", [True, False], ids=["save", "load"])
def test_mirrored_copy_leaves_the_bytes_copy_layers_leaves(case, saving, monkeypatch):
    cache_kind, cache_block, staged_kind, staged_block, t0, t1, layers_a_piece = case
    # A piece as small as a few layers' blocks: the copy runs in several pieces.
    monkeypatch.setattr(device_copies, "SCRATCH_BYTES", layers_a_piece * 2 * HEADS * N * 64)
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    cache, blocks = random_cache(cache_kind, cache_block, gen)
    region, staged = random_region(staged_kind, staged_block, gen)
    staged_blocks = list(range(blocks_for_tokens(N, staged_block)))
    want_cache = [(k.clone(), v.clone()) for k, v in cache]
    want_region = region.clone()
    want_staged = StagingFormat(
        staged_kind, KVGeometry(HEADS, HEAD_DIM, staged_block, torch.float16), LAYERS
    ).layer_views(want_region[64:], N)
    want_cache_views = want_cache
    heads = None if saving else HeadRange(1, 3, 1)  # a TP shard: heads 1, 2 only
    if saving:
        copy_layers(cache, blocks, want_staged, staged_blocks, t0, t1)
        if t1 % staged_block:  # a save leaves its last block's unused tokens zero
            for plane in (p for kv in want_staged for p in kv):
                plane[t1 // staged_block, :, t1 % staged_block :] = 0
        mirrored_copy(cache, blocks, staged, staged_blocks, t0, t1, None, None,
                      saving=True, device=CPU)  # fmt: skip
        assert torch.equal(region, want_region)
    else:
        copy_layers(want_staged, staged_blocks, want_cache_views, blocks, t0, t1, heads)
        mirrored_copy(staged, staged_blocks, cache, blocks, t0, t1, heads, None,
                      saving=False, device=CPU)  # fmt: skip
        for (k, v), (wk, wv) in zip(cache, want_cache_views, strict=True):
            assert torch.equal(k.view(torch.int16), wk.view(torch.int16))
            assert torch.equal(v.view(torch.int16), wv.view(torch.int16))


def test_a_staged_window_that_is_not_consecutive_is_refused():
    gen = torch.Generator().manual_seed(1)
    cache, blocks = random_cache("LBHNC", 16, gen)
    _, staged = random_region("LBHNC", 16, gen)
    with pytest.raises(ValueError, match="not consecutive"):
        mirrored_copy(cache, blocks, staged, [0, 2, 1], 0, N, None, None, saving=True, device=CPU)


def test_layers_evenly_spaced_in_one_allocation_stack_into_one_view():
    """On a GPU a copy covers every layer at once where each side's layers stack: as
    vLLM allocates its caches and as staging lays a request out, never otherwise."""
    from vllm_qaic_connector.kv.token_copies import _stacked

    whole = torch.arange(4 * 2 * 3 * 5, dtype=torch.float32).view(4, 2, 3, 5)
    planes = [t[:, :, :3] for t in whole]  # K of each layer: strided, evenly spaced
    stacked = _stacked(planes)
    assert stacked is not None and stacked.shape == (2, 3, 3, 4)
    for i, plane in enumerate(planes):
        assert torch.equal(stacked[..., i], plane)
    assert _stacked([planes[0], planes[2], planes[3]]) is None  # a gap
    assert _stacked([planes[0], planes[1].clone()]) is None  # another allocation
