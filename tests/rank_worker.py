"""One real WorkerSide per process, for the multi-rank tests (spawned by multiprocessing)."""

from __future__ import annotations

import queue
import time
from typing import Any

import numpy as np
import torch

from vllm_qaic_connector.config import parse_config
from vllm_qaic_connector.kv.kv_groups import KVGroup
from vllm_qaic_connector.kv.layout import KVGeometry, VllmPagedLayout, gather_tokens, get_layout
from vllm_qaic_connector.kv.tp_mapping import heads_of_rank
from vllm_qaic_connector.stats import QAICConnectorStats
from vllm_qaic_connector.step_metadata import LoadSpec, QAICConnectorMetadata, SaveSpec
from vllm_qaic_connector.worker import request_saves, worker_side
from vllm_qaic_connector.worker.this_rank import RankIdentity
from vllm_qaic_connector.worker.worker_side import WorkerSide

HEAD, LAYERS, NUM_BLOCKS = 32, 2, 24


def plain(kv_per_layer: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[Any, Any]]:
    # numpy crosses the queue by value; torch tensors would go by shared-memory handle,
    # which dies with this process. As bytes: numpy has no bf16 or fp8.
    return [(as_bytes(k), as_bytes(v)) for k, v in kv_per_layer]


def as_bytes(t: torch.Tensor) -> Any:
    return t.contiguous().view(torch.uint8).cpu().numpy().copy()


def vllm_kv_caches(
    kind: str, geo: KVGeometry, layers: int, num_blocks: int, gen: torch.Generator,
    device: str = "cpu",
) -> list[torch.Tensor]:  # fmt: skip
    """Per-layer caches exactly as a vLLM 0.32 engine builds them for ``kind``: one raw
    allocation, strides from vLLM's layout math, views from `create_kv_cache_views`."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[kind]
    spec = FullAttentionSpec(
        block_size=geo.block_size, num_kv_heads=geo.num_heads, head_size=geo.head_size,
        dtype=geo.dtype,
    )  # fmt: skip
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, layout)
    size = layers * num_blocks * spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    where = KVCacheTensor(size, names, layer_stride, block_stride)
    raw = torch.empty(size, dtype=torch.int8, device=device)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, where)
    for v in views:  # finite values of every dtype: bytes compare exactly after copies
        v.copy_(torch.randn(v.shape, generator=gen).to(geo.dtype))
    return views


def make_worker(args: dict[str, Any], seed: int) -> WorkerSide:
    """A WorkerSide for rank ``args["rank"]`` with random KV caches in ``args["layout"]``."""
    torch.set_num_threads(1)
    rank, tp, total = args["rank"], args["tp"], args["total_heads"]
    geo = KVGeometry(
        len(heads_of_rank(total, tp, rank)),
        args.get("head_size", HEAD),
        args["block"],
        getattr(torch, args.get("dtype", "float32")),
    )
    w = WorkerSide(
        parse_config(args["extra"]),
        RankIdentity(args["engine"], rank, tp, total, "m"),
        geo,
        hybrid_groups(args["block"], args.get("window", 0)),
    )
    kind, device = get_layout(args["layout"]), args.get("device", "cpu")
    gen = torch.Generator().manual_seed(seed)
    if isinstance(kind, VllmPagedLayout):
        views = vllm_kv_caches(args["layout"], geo, LAYERS, NUM_BLOCKS, gen, device)
    else:  # one allocation viewed per layer, as vLLM allocates them (direct reads need that)
        shape = (LAYERS, *kind.physical_shape(NUM_BLOCKS, geo))
        views = list(torch.randn(shape, generator=gen).to(geo.dtype).to(device))
    caches = {f"model.layers.{i}.self_attn.attn": view for i, view in enumerate(views)}
    w.register_kv_caches(caches, layout=kind)
    return w


def hybrid_groups(block: int, window: int) -> tuple[KVGroup, ...]:
    """With a window: layer 0 sliding-window (group 0), layer 1 full attention (group 1)."""
    if not window:
        return ()
    name = "model.layers.{}.self_attn.attn".format
    return (KVGroup(block, window, (name(0),)), KVGroup(block, 0, (name(1),)))


def by_group(w: WorkerSide, block_ids: tuple[list[int], ...], n: int) -> list[Any]:
    """Each layer's first ``n`` tokens, read through its own group's blocks."""
    assert w.cache is not None
    group = w.cache.group
    return plain([gather_tokens(kv, block_ids[group(i)], n) for i, kv in enumerate(w.layers)])


def prefill_rank(args: dict[str, Any], inbox: Any, outbox: Any) -> None:
    # These saves are small enough to run in the step; with async_saves they go to the
    # save thread instead, the path a real prompt takes (test_async_save covers in-step).
    request_saves.INLINE_SAVE_BYTES = 0
    w = make_worker(args, 100 + args["rank"])
    spec: SaveSpec = args["save"]
    before = [(k.clone(), v.clone()) for k, v in w.layers]
    w.bind(QAICConnectorMetadata(saves=[spec]))
    w.wait_for_save()
    unchanged = all(
        torch.equal(k, bk) and torch.equal(v, bv)
        for (k, v), (bk, bv) in zip(w.layers, before, strict=True)
    )
    ref = by_group(w, spec.block_ids, spec.num_tokens)
    outbox.put({"meta": w.rank_meta, "ref": ref, "unchanged": unchanged})
    acks = []  # acknowledgements that arrive with the decode's reads (NIXL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        meta = w.take_acknowledgements()
        acks += [(a.request_ids[0], a.reader_rank, a.reader_tp) for a in meta.acks] if meta else []
        try:
            inbox.get(timeout=0.05)
            # A notification may trail the read it rides on: keep listening a moment.
            deadline = min(deadline, time.monotonic() + 1.0)
        except queue.Empty:
            pass
    outbox.put({"acks": acks})
    w.shutdown()


def decode_rank(args: dict[str, Any], inbox: Any, outbox: Any) -> None:
    w = make_worker(args, 200 + args["rank"])
    spec: LoadSpec = inbox.get(timeout=120)
    before = by_group(w, spec.block_ids, spec.first_token)
    null_before = plain([(k[0], v[0]) for k, v in w.layers])  # block 0: vLLM's null block
    # idle: the engine computes nothing this step, so the worker waits for this load
    # (here up to 60 s, its handshake included) and reports it in the same step.
    worker_side.IDLE_LOAD_WAIT_S = 60.0
    w.bind(QAICConnectorMetadata(loads=[spec], idle=args.get("idle", False)))
    w.start_load_kv()
    deadline, done = time.monotonic() + 60, None
    _, first = w.get_finished()
    done = first
    while done is None and time.monotonic() < deadline:
        _, done = w.get_finished()
        time.sleep(0.01)
    errors = w.get_block_ids_with_load_errors()
    n = spec.end
    got = by_group(w, spec.block_ids, n)
    null_after = plain([(k[0], v[0]) for k, v in w.layers])
    outbox.put(
        {
            "done": done,
            "first": first,
            "errors": errors,
            "got": got,
            "prefix_before": before,
            "null_untouched": all(
                np.array_equal(a, b)
                for after, was in zip(null_after, null_before, strict=True)
                for a, b in zip(after, was, strict=True)
            ),
            "stats": (w.get_stats() or QAICConnectorStats()).data,
        }
    )
    w.shutdown()
