"""One real WorkerSide per process, for the multi-rank tests (spawned by multiprocessing)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from typing import Any

import msgspec
import numpy as np
import torch

from testbed.shipped_model import TINY
from testbed.shm_objects import segments
from vllm_qaic_connector import worker_side
from vllm_qaic_connector.config import parse_config
from vllm_qaic_connector.kv.kv_groups import (
    KVGroup,
    kept_start,
    load_starts,
    staged_starts,
    tokens_to_load,
)
from vllm_qaic_connector.kv.token_copies import gather_tokens
from vllm_qaic_connector.kv.tp_mapping import heads_of_rank
from vllm_qaic_connector.layout import KVGeometry, VllmPagedLayout, blocks_for_tokens, get_layout
from vllm_qaic_connector.protocol.side_channel import SideChannelServer
from vllm_qaic_connector.protocol.ticket import RemotePrefill, ticket_binding
from vllm_qaic_connector.protocol.wire import (
    PROTOCOL_VERSION,
    HandshakeReply,
    HandshakeRequest,
    Ok,
    ReleaseRequest,
)
from vllm_qaic_connector.stats import QAICConnectorStats
from vllm_qaic_connector.step_metadata import LoadSpec, QAICConnectorMetadata, SaveSpec
from vllm_qaic_connector.worker import request_saves
from vllm_qaic_connector.worker.registration import RankIdentity
from vllm_qaic_connector.worker_side import WorkerSide

HEAD, LAYERS, NUM_BLOCKS = TINY.head_size, TINY.layers, 24


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
    allocation, strides from vLLM's layout math, views from `create_kv_cache_views`. An
    MLA latent (`mla_latent`) of ``2 * geo.head_size`` values, as vLLM's CPU builds it."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    mla = kind == "mla_latent"
    layout = KVCacheLayout["LBNHC" if mla else kind]
    spec = (MLAAttentionSpec if mla else FullAttentionSpec)(
        block_size=geo.block_size, num_kv_heads=geo.num_heads,
        head_size=(2 if mla else 1) * geo.head_size, dtype=geo.dtype,
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
            # A NIXL notification may trail the read it rides on: keep listening a moment.
            linger = 1.0 if args["extra"]["transport"] == "nixl" else 0.0
            deadline = min(deadline, time.monotonic() + linger)
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
    # A load in the step is in place when start_load_kv returns (the forward pass follows).
    at_return = by_group(w, spec.block_ids, spec.end)
    deadline, done = time.monotonic() + 60, None
    _, first = w.get_finished()
    done = first
    while done is None and not spec.in_step and time.monotonic() < deadline:
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
            "at_return": at_return,
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


# A rank is a process of its own, as in vLLM, but forked from a server that has imported
# the worker once: a spawned one spends ~14 s of CPU importing vLLM and torch here. The
# registration imports vLLM's model utils lazily (0.6 s a rank): preloaded too.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["testbed.worker_processes", "vllm.model_executor.models.utils"])


def start_ranks(target, tp: int, common: dict) -> tuple[list, list]:
    """One process per TP rank running ``target``, each with an (inbox, outbox) pair."""
    queues = [(CTX.Queue(), CTX.Queue()) for _ in range(tp)]
    procs = [
        CTX.Process(target=target, args=({**common, "rank": r, "tp": tp}, *queues[r]))
        for r in range(tp)
    ]
    for p in procs:
        p.start()
    return procs, queues


def run_handoff(
    total_heads,
    p_tp,
    d_tp,
    p_layout,
    p_block,
    d_layout,
    d_block,
    num_tokens,
    first_token=0,
    d_head_size=32,
    transport="shm",
    stale=0,
    holds_until=0.0,
    edited=None,
    window=0,
    async_saves=True,
    idle=False,
    dtype="float32",
    device="cpu",
    in_step=False,
):
    engine = f"pf{os.getpid()}"
    n_src_blocks = blocks_for_tokens(num_tokens, p_block)
    generation = (5 << 32) + 1
    p_groups, d_groups = hybrid_groups(p_block, window), hybrid_groups(d_block, window)
    starts = staged_starts(p_groups, num_tokens, p_block, (0, 0)) if window else (0,)
    src_blocks = [list(range(n_src_blocks, 0, -1))] * len(starts)
    if window:  # the sliding-window group has its own block table
        src_blocks[0] = list(range(1, n_src_blocks + 1))
    ticket = RemotePrefill(  # its port and incarnation once the prefill runs
        do_remote_prefill=True,
        remote_engine_id=engine,
        remote_host="127.0.0.1",
        remote_port=1,
        remote_request_id="r1",
        num_tokens=num_tokens,
        staging_offset=4096,
        staged_layout=p_layout,
        staged_block_size=p_block,
        incarnation="",
        generation=generation + stale,
        prompt_hash="0" * 32,  # the decode's scheduler checks it, not the worker
        lease_s=60.0,
        expires_at=time.time() + 60.0,
        group_starts=starts if window else (),
    )
    save = SaveSpec(
        request_id="r1", block_ids=tuple(src_blocks), num_tokens=num_tokens, staging_offset=4096,
        layout_kind=p_layout, block_size=p_block, generation=generation, starts=starts,
        binding=ticket_binding(ticket),
    )  # fmt: skip
    procs, pre = start_ranks(
        prefill_rank,
        p_tp,
        dict(
            engine=engine,
            total_heads=total_heads,
            layout=p_layout,
            block=p_block,
            extra={"transport": transport, "async_saves": async_saves},
            save=save,
            window=window,
            dtype=dtype,
            device=device,
        ),
    )
    released: list[str] = []
    results = [q[1].get(timeout=180) for q in pre]
    ranks = [r["meta"] for r in results]

    def handle(msg):
        if isinstance(msg, HandshakeRequest):
            return HandshakeReply(PROTOCOL_VERSION, ranks)
        if isinstance(msg, ReleaseRequest):
            released.extend(msg.request_ids)
        return Ok()

    server = SideChannelServer("127.0.0.1", 0, handle, None)
    remote = msgspec.structs.replace(
        ticket, remote_port=server.port, incarnation=ranks[0].incarnation, **(edited or {})
    )
    dprocs, dec = start_ranks(
        decode_rank,
        d_tp,
        dict(
            engine=f"d{os.getpid()}",
            total_heads=total_heads,
            layout=d_layout,
            block=d_block,
            extra={"transport": transport},
            head_size=d_head_size,
            window=window,
            idle=idle,
            dtype=dtype,
            device=device,
        ),
    )
    claimed = tokens_to_load(num_tokens, d_groups)
    d_blocks = [list(range(3, 3 + blocks_for_tokens(claimed, d_block)))]
    load = LoadSpec(
        request_id="d1", block_ids=(d_blocks[0],), first_token=first_token, remote=remote,
        holds_until=holds_until, in_step=in_step,
    )  # fmt: skip
    if window:  # the decode keeps the window's blocks; vLLM's null block (0) pads the rest
        d_starts = load_starts(d_groups, claimed, first_token)
        kept = kept_start(claimed, window, d_block) // d_block
        sliding = [0] * kept + [22 - i for i in range(len(d_blocks[0]) - kept)]
        load = LoadSpec(
            request_id="d1", block_ids=(sliding, d_blocks[0]), first_token=first_token,
            remote=remote, holds_until=holds_until, starts=d_starts, claimed=claimed,
        )  # fmt: skip
    for q in dec:
        q[0].put(load)
    outs = [q[1].get(timeout=180) for q in dec]
    for q in pre:
        q[0].put("exit")
    acks = sorted({a for q in pre for a in q[1].get(timeout=60)["acks"]})
    for p in procs + dprocs:
        p.join(60)
    server.close()
    assert all(p.exitcode == 0 for p in procs + dprocs)
    leftovers = segments((f"qaic_kv_{engine}_", f"qaic_kv_d{os.getpid()}_"))
    assert leftovers == set(), "shared-memory segments leaked"
    return results, outs, released + [f"{r}@{rank}/{tp}" for r, rank, tp in acks]


def full_heads(results, total_heads, p_tp, layer, kv):
    """Reassemble all heads from the prefill shards (replicas must agree)."""
    heads = {}
    for rank, res in enumerate(results):
        for i, h in enumerate(heads_of_rank(total_heads, p_tp, rank)):
            heads.setdefault(h, res["ref"][layer][kv][i])
    return np.stack([heads[h] for h in range(total_heads)])


VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# vLLM's KV cache dtypes (fp8 as its CPU backend allows it); a pair's dtype and block sizes
# rotate with it, so every layout meets every other, each dtype and a re-blocking.
VLLM_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
VLLM_PAIRS = [
    (src, dst, VLLM_DTYPES[(i + j) % 3], (16, 32, 64)[i % 3], (16, 32, 64)[(i + 2 * j) % 3])
    for i, src in enumerate(VLLM_LAYOUTS)
    for j, dst in enumerate((*VLLM_LAYOUTS, "vllm_cpu_vec", "qaic_slot"))
    if not (dst == "vllm_cpu_vec" and (i + j) % 3 == 2)  # vLLM's CPU cache op has no fp8
]
# vLLM CPU's packings (one per attention ISA family), each against each (re-blocking too) and
# amx against a GPU layout and the QAIC slots, both ways: peers on different CPUs convert.
CPU_KINDS = ("vllm_cpu_vec", "vllm_cpu_amx", "vllm_cpu_neon_bf16")
VLLM_PAIRS += [
    (src, dst, ("bfloat16", "float32")[(i + j) % 2], (32, 64)[i % 2], (32, 64, 128)[j % 3])
    for i, src in enumerate(CPU_KINDS)
    for j, dst in enumerate(CPU_KINDS)
] + [
    ("vllm_cpu_amx", "LBNHC", "bfloat16", 64, 16), ("LBHNC", "vllm_cpu_amx", "bfloat16", 16, 32),
    ("vllm_cpu_amx", "qaic_slot", "bfloat16", 32, 128),
]  # fmt: skip
