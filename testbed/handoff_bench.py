"""KV handoff throughput of the connector's own code paths, each next to memcpy of its bytes.

    .venv/bin/python -m testbed.handoff_bench --quick --json rows.json --plot rows.png

A handoff moves a prompt's KV (random bytes in shuffled blocks) from a prefill's KV cache to
a decode's as the worker does: save (`copy_layers` into staging under a ticket header, the
layers split over two threads where two cores are usable), then load (`checked_read` through
a second transport and `copy_layers` into shuffled blocks, or
into QAIC slot 1 by `SlotTarget.write_slot_from_blocks`, or by `SlotPuller.pull`). Both
NIXL agents live in this process; their bytes still go through UCX. The direct path (what
the worker does when both sides share a host, and over NIXL a format) saves only the ticket;
its load maps the prefill's cache, moved into shm by `share_kv_cache`, and copies whole
blocks, or converts them with `copy_layers` where the formats differ.

Each (path, tokens) runs once untimed first; after the timed handoffs the decode's KV is
zeroed, one more handoff runs, and its tokens must equal the prefill's byte for byte (else
MISMATCH and exit status 1). A row keeps the best of --repeats handoffs; its ratio is to
the best of 5 np.copyto of its bytes between two pre-faulted arrays (one thread) right
after it. With ``--device cuda`` the caches live on the GPU, the staging is page-locked
as the worker makes it, and the ratio is to the best of 5 pinned ``copy_`` of the bytes to
the host and back (a save's and a load's traffic). A row needs ~4x a request's bytes
(32k default tokens: 16 GiB).
Ctrl-C or SIGTERM stops the run after its current step; the rows so far are still written.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, closing
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm_qaic_connector.kv.copy_pool import CopyPool
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.kv.token_copies import gather_tokens
from vllm_qaic_connector.layout import KVGeometry, blocks_for_tokens, get_layout
from vllm_qaic_connector.qaic.slot_pull import SlotPuller
from vllm_qaic_connector.qaic.target import BufferSpec, Manifest, SlotTarget
from vllm_qaic_connector.region_headers import (
    HEADER_BYTES,
    RegionHeaders,
    checked_read,
    new_incarnation,
)
from vllm_qaic_connector.transports import KVTransport, create_transport, staging_name
from vllm_qaic_connector.worker.direct_reads import DirectReader, cache_endpoint, plan_cache_reads

KV = tuple[torch.Tensor, torch.Tensor]
Cache = tuple[list[KV], list[int]]  # canonical views of each layer, the request's block ids
Row = dict[str, Any]
Fmt = tuple[str, int]  # layout kind, block size (0: all the tokens in one block, a QAIC slot)
HND16, NHD64, CPU128, SLOT = ("LBHNC", 16), ("LBNHC", 64), ("vllm_cpu_vec", 128), ("qaic_slot", 0)
GENERATION = 0x5EED_0001  # the staged request's ticket
QUICK_TOKENS, DEFAULT_TOKENS = [512, 1024, 2048], [1024, 2048, 4096, 8192, 16384, 32768]
CUDA_DIRECT = ("nixl",)  # READs from one registered GPU cache into another


class Path(NamedTuple):
    label: str
    transport: str
    prefill: Fmt
    staged: Fmt
    decode: Fmt
    pull: bool = False  # NIXL READs straight into the decode's QAIC slot
    direct: bool = False  # no staging: the decode reads the prefill's cache
    slot_dtype: str = ""  # a QAIC program's KV dtype, when not the prefill's: converted


PATHS = {  # shm-reblock stages in the decode's format, nixl-staged in the prefill's
    "shm": Path("shm direct (HND 16)", "shm", HND16, HND16, HND16, direct=True),
    "shm-128": Path("shm direct (CPU 128)", "shm", CPU128, CPU128, CPU128, direct=True),
    "shm-staged": Path("shm staged (HND 16)", "shm", HND16, HND16, HND16),
    "shm-reblock": Path("shm re-block+permute", "shm", NHD64, HND16, HND16),
    "shm-convert": Path("shm direct, converted", "shm", NHD64, NHD64, HND16, direct=True),
    "shm-cpu-slot": Path("shm vllm_cpu→qaic slot", "shm", CPU128, CPU128, SLOT),
    "nixl": Path("nixl direct (HND 16)", "nixl", HND16, HND16, HND16, direct=True),
    "nixl-128": Path("nixl direct (CPU 128)", "nixl", CPU128, CPU128, CPU128, direct=True),
    "nixl-staged": Path("nixl staged (HND 16)", "nixl", HND16, HND16, HND16),
    "nixl-convert": Path("nixl staged, converted", "nixl", NHD64, NHD64, HND16),
    "slot-write": Path("qaic slot write", "shm", CPU128, SLOT, SLOT),
    "slot-convert": Path("qaic slot write→fp16", "shm", CPU128, SLOT, SLOT, slot_dtype="float16"),
    "nixl-slot": Path("nixl→qaic slot", "nixl", CPU128, SLOT, SLOT, pull=True),
}


class Shape(NamedTuple):
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: str = "cpu"  # where the KV caches live (staging is host memory)

    def geo(self, fmt: Fmt, tokens: int) -> KVGeometry:
        return KVGeometry(self.heads, self.head_dim, fmt[1] or tokens, self.dtype)

    def nbytes(self, tokens: int) -> int:
        return 2 * self.layers * self.heads * self.head_dim * self.dtype.itemsize * tokens


class Mismatch(Exception):
    """The decode's tokens are not the prefill's."""


class Case(NamedTuple):
    """One path set up for one token count: ``save`` then ``load`` is one handoff."""

    save: Callable[[], object]
    load: Callable[[], object]
    src: Cache  # the prefill's KV cache
    dst: Cache  # the decode's KV cache, or its QAIC KV buffers and [slot]


def kv_cache(
    shape: Shape, fmt: Fmt, n: int, gen: torch.Generator, fill: bool
) -> tuple[list[torch.Tensor], Cache]:
    """A cache of exactly ``n`` tokens' blocks, one allocation as vLLM makes it: its layer
    tensors, and (their views, shuffled block ids); ``fill``: random bytes, each layer
    different."""
    geo, layout = shape.geo(fmt, n), get_layout(fmt[0])
    nb = blocks_for_tokens(n, geo.block_size)
    dims = (shape.layers, *layout.physical_shape(nb, geo))
    physical = list(torch.zeros(dims, dtype=geo.dtype, device=shape.device))
    if fill:
        size = physical[0].numel() * geo.dtype.itemsize
        pool = torch.randint(0, 256, (size + shape.layers,), dtype=torch.uint8, generator=gen)
        for i, t in enumerate(physical):
            t.view(-1).view(torch.uint8).copy_(pool[i : i + size])
    layers = [layout.layer_view(t) for t in physical]
    views = [layout.kv_views(t, geo) for t in layers]
    return layers, (views, torch.randperm(nb, generator=gen).tolist())


def transports(kind: str, nbytes: int, stack: ExitStack) -> list[KVTransport]:
    """The prefill's transport and the decode's, as `WorkerSide` makes them (staging and
    NIXL receive arena: ``nbytes`` rounded up to a page)."""
    size, engine = -(-nbytes // 4096) * 4096, f"bench{os.getpid()}"
    names = [staging_name(engine, rank, new_incarnation()) for rank in (0, 1)]
    return [stack.enter_context(closing(create_transport(kind, n, size, 60.0))) for n in names]


def slot_target(shape: Shape, n: int, stack: ExitStack, dtype: str) -> SlotTarget:
    """A QAIC decode's KV buffers in shm: two slots of ``n`` tokens of ``dtype`` (""; the
    prefill's)."""
    dims = (2, shape.heads, n, shape.head_dim)
    dtype = dtype or str(shape.dtype).removeprefix("torch.")
    names = [f"past_{kv}.{i}_RetainedState" for i in range(shape.layers) for kv in ("key", "value")]
    manifest = Manifest([[BufferSpec(name, dims, dtype) for name in names]])
    prefix = f"qaic_kv_bench{os.getpid()}_{new_incarnation()}"
    return stack.enter_context(closing(SlotTarget(manifest, prefix, None)))


def build(path: Path, shape: Shape, n: int, stack: ExitStack) -> Case:
    """Sets ``path`` up for ``n`` tokens; ``stack`` closes everything it opened."""
    if path.direct:
        return direct_case(path, shape, n, stack)
    gen = torch.Generator().manual_seed(n)
    _, (src, src_blocks) = kv_cache(shape, path.prefill, n, gen, fill=True)
    if path.slot_dtype:  # NaN payloads need not survive a conversion: values, not bytes
        for plane in (t for kv in src for t in kv):
            plane.nan_to_num_()
    fmt = StagingFormat(path.staged[0], shape.geo(path.staged, n), shape.layers)
    nbytes = HEADER_BYTES + fmt.request_bytes(n)
    owner, reader = transports(path.transport, nbytes, stack)
    if shape.device != "cpu":  # as the worker does for a GPU's cache
        for transport in (owner, reader):
            transport.pin_host_memory()
    peer, headers = owner.endpoint(), RegionHeaders(owner.staging)
    staged_blocks = list(range(blocks_for_tokens(n, fmt.geometry.block_size)))
    notify = b"ack" if reader.delivers_notifications else None
    pool = stack.enter_context(closing(CopyPool()))  # the worker's second copy thread

    def save() -> None:
        owner.poll_notifications()  # the prefill takes the decode's acknowledgements
        with headers.writing(0, nbytes, GENERATION) as region:
            pool.layers(src, src_blocks, fmt.layer_views(region, n), staged_blocks, 0, n)

    if path.decode == SLOT:
        target = slot_target(shape, n, stack, path.slot_dtype)
        slot = [target.allocate_slot() for _ in range(2)][1]
        dst, dst_blocks = [target.kv(i) for i in range(shape.layers)], [slot]

        def write(views: list[KV]) -> None:
            target.write_slot_from_blocks(slot, views, staged_blocks, n)

        if path.pull:
            # the reader is a NixlTransport on this path
            puller = stack.enter_context(closing(SlotPuller(target, reader)))  # type: ignore[arg-type]
            pull = lambda: puller.pull(slot, peer, 0, fmt.geometry, n, GENERATION, notify)  # noqa: E731
            return Case(save, pull, (src, src_blocks), (dst, dst_blocks))
    else:
        _, (dst, dst_blocks) = kv_cache(shape, path.decode, n, gen, fill=False)

        def write(views: list[KV]) -> None:
            pool.layers(views, staged_blocks, dst, dst_blocks, 0, n)

    def load() -> None:
        with checked_read(reader, peer, 0, fmt.request_bytes(n), GENERATION, notify) as region:
            write(fmt.layer_views(region, n))

    return Case(save, load, (src, src_blocks), (dst, dst_blocks))


def direct_case(path: Path, shape: Shape, n: int, stack: ExitStack) -> Case:
    """The prefill's cache moved into shm or registered with NIXL, and the decode's too;
    the ticket is a header-only staging region."""
    gen = torch.Generator().manual_seed(n)
    geo, layout = shape.geo(path.prefill, n), get_layout(path.prefill[0])
    prefill_layers, (src, src_blocks) = kv_cache(shape, path.prefill, n, gen, fill=True)
    decode_layers, (dst, dst_blocks) = kv_cache(shape, path.decode, n, gen, fill=False)
    owner, reader = transports(path.transport, HEADER_BYTES, stack)
    headers = RegionHeaders(owner.staging)
    shared = owner.share_kv_cache(prefill_layers, produces=True)
    assert shared is not None
    if not shared.mapped:
        assert reader.share_kv_cache(decode_layers, produces=False)
        region = cache_endpoint(owner.endpoint(), shared)  # its metadata covers the cache

        def move() -> None:
            blocks = (src_blocks, dst_blocks)
            reader.read_into(region, plan_cache_reads(shared, layout, decode_layers, blocks))

    else:
        pool = stack.enter_context(closing(CopyPool()))
        direct = stack.enter_context(closing(DirectReader(pool)))
        mapped = direct.peer("bench/0", shared, layout, geo)

        def move() -> None:
            if path.prefill == path.decode:
                direct.copy(mapped, src_blocks, decode_layers, dst_blocks)
            else:
                pool.layers(mapped.layers, src_blocks, dst, dst_blocks, 0, n)

    peer, notify = owner.endpoint(), b"ack" if reader.delivers_notifications else None

    def save() -> None:
        owner.poll_notifications()
        with headers.writing(0, HEADER_BYTES, GENERATION):
            pass

    def load() -> None:
        with checked_read(reader, peer, 0, 0, GENERATION, notify):
            move()

    return Case(save, load, (src, src_blocks), (dst, dst_blocks))


def mismatches(src: Cache, dst: Cache, n: int) -> list[str]:
    """Planes whose tokens ``[0, n)`` differ, byte for byte (random bytes hold NaNs) from
    the prefill's in the decode's dtype."""
    bad = []
    for layer, (s_kv, d_kv) in enumerate(zip(src[0], dst[0], strict=True)):
        want, got = gather_tokens(s_kv, src[1], n), gather_tokens(d_kv, dst[1], n)
        for name, w, g in zip("KV", want, got, strict=True):
            w, g = (t.contiguous().view(torch.uint8).cpu() for t in (w.to(g.dtype), g))
            if not torch.equal(w, g):
                bad.append(f"layer {layer} {name}")
    return bad


STOP: list[int] = []  # signals received: acted on between steps, so cleanup always runs


def on_signal(signum: int, frame: object) -> None:
    if STOP:  # a second Ctrl-C: now, at any point (may leave a half-made segment behind)
        raise KeyboardInterrupt
    STOP.append(signum)
    print("stopping after this step (again: at once)", file=sys.stderr, flush=True)


def seconds(step: Callable[[], object]) -> float:
    if STOP:
        raise KeyboardInterrupt
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def measure(path: Path, shape: Shape, n: int, repeats: int, corrupt: bool) -> Row:
    """One row, or Mismatch. Every shm segment and NIXL registration is gone before the
    memcpy runs, and when this raises (Ctrl-C included)."""
    with ExitStack() as stack:
        case = build(path, shape, n, stack)
        case.save(), case.load()  # untimed: every page faulted in
        timed = [(seconds(case.save), seconds(case.load)) for _ in range(repeats)]
        for view in (v for kv in case.dst[0] for v in kv):
            view.zero_()  # so the checked handoff, along the plans the timed ones used, writes all
        case.save(), case.load()
        if corrupt:  # negative control: one flipped bit must fail the run
            case.dst[0][-1][1][case.dst[1][0], 0, 0].view(torch.uint8)[:1].bitwise_xor_(1)
        if bad := mismatches(case.src, case.dst, n):
            raise Mismatch(f"{len(bad)} of {2 * shape.layers} planes differ: {bad[:4]}")
        del case  # the memcpy's arrays replace the path's buffers
    (save_s, load_s), nbytes = min(timed, key=sum), shape.nbytes(n)
    reference = memcpy_seconds if shape.device == "cpu" else pinned_copy_seconds
    gbps, memcpy_gbps = nbytes / (save_s + load_s) / 1e9, nbytes / reference(nbytes, 5) / 1e9
    return {
        "path": path.label, "tokens": n, "bytes": nbytes, "seconds": save_s + load_s,
        "gbps": gbps, "ratio_to_memcpy": gbps / memcpy_gbps, "memcpy_gbps": memcpy_gbps,
        "save_gbps": nbytes / save_s / 1e9, "load_gbps": nbytes / load_s / 1e9,
    }  # fmt: skip


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """Best np.copyto of ``nbytes`` between two faulted-in arrays (one thread)."""
    src, dst = np.full(nbytes, 7, dtype=np.uint8), np.full(nbytes, 0, dtype=np.uint8)
    return min(seconds(lambda: np.copyto(dst, src)) for _ in range(repeats))


def pinned_copy_seconds(nbytes: int, repeats: int) -> float:
    """Best pinned ``copy_`` of ``nbytes`` from the GPU to the host and back: the bytes of a
    save (device to host) and a load (host to device) at PCIe speed."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")

    def there_and_back() -> None:
        host.copy_(device, non_blocking=True)
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    return min(seconds(there_and_back) for _ in range(repeats))


def show(r: Row) -> None:
    print(f"{r['path']:<24}{r['tokens']:>7}{r['bytes'] / 2**20:>8.1f}{r['save_gbps']:>10.2f}"
          f"{r['load_gbps']:>10.2f}{r['gbps']:>8.2f}{r['memcpy_gbps']:>8.2f}"
          f"{r['ratio_to_memcpy']:>7.3f}", flush=True)  # fmt: skip


def by_path(rows: list[Row]) -> dict[str, list[Row]]:
    labels = dict.fromkeys(r["path"] for r in rows)  # in the order they first ran
    return {label: [r for r in rows if r["path"] == label] for label in labels}


def plot(rows: list[Row], out: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no figure to close

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for label, mine in by_path(rows).items():
        ax.plot([r["tokens"] for r in mine], [r["gbps"] for r in mine], marker="o", label=label)
    ticks = sorted({r["tokens"] for r in rows})
    ax.set(xscale="log", xlabel="tokens", ylabel="GB/s (save + load)", title="KV handoff")
    ax.set(ylim=(0, None), xticks=ticks, xticklabels=[str(t) for t in ticks])
    ax.minorticks_off()
    ax.legend(fontsize="small")
    fig.savefig(out, dpi=120, bbox_inches="tight")


def parse(argv: list[str] | None) -> argparse.Namespace:
    epilog = "paths: prefill -> staged -> decode format (layout, block; n: all tokens)" + "".join(
        f"\n  {k:<13} {p.label}: " + " -> ".join(f"{f[0]} {f[1] or 'n'}" for f in p[2:5])
        for k, p in PATHS.items()
    )
    p = argparse.ArgumentParser(
        "python -m testbed.handoff_bench", description=__doc__, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS}, 2 repeats")
    p.add_argument("--tokens", type=int, nargs="+", help=f"default {DEFAULT_TOKENS}")
    p.add_argument("--repeats", type=int, help="timed handoffs per row, best kept (default 5)")
    nixl = importlib.util.find_spec("nixl") is not None
    usable = [k for k, v in PATHS.items() if nixl or v.transport == "shm"]
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=usable, metavar="PATH",
                   help="default: all (those over NIXL if nixl is installed)")  # fmt: skip
    for flag, default in (("--layers", 32), ("--kv-heads", 8), ("--head-dim", 128)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    help = "where the caches live; cuda: staged paths and nixl's direct one, against a pinned copy_"
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help=help)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--plot", help="draw GB/s against tokens into this PNG (needs matplotlib)")
    p.add_argument("--corrupt", action="store_true", help="negative control: must exit 1")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    args.repeats = args.repeats or (2 if args.quick else 5)
    if args.device == "cuda":  # a GPU's cache is shared directly over NIXL only (as VRAM)
        args.paths = [k for k in args.paths if not PATHS[k].direct or k in CUDA_DIRECT]
    if min(args.tokens + [args.repeats, args.layers, args.kv_heads, args.head_dim]) < 1:
        p.error("tokens, repeats, layers, kv-heads and head-dim must be >= 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib (pip install matplotlib)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines would split the table
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = Shape(args.layers, args.kv_heads, args.head_dim, dtype, args.device)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    reference = "np.copyto" if args.device == "cpu" else "pinned copy_, both ways"
    print(f"{shape.layers} layers x {shape.heads} KV heads x {shape.head_dim} {args.dtype} on "
          f"{args.device}, best of {args.repeats}, torch threads {torch.get_num_threads()}; "
          f"memcpy: {reference}")  # fmt: skip
    print(f"{'path':<24}{'tokens':>7}{'MiB':>8}{'save GB/s':>10}{'load GB/s':>10}{'GB/s':>8}"
          f"{'memcpy':>8}{'ratio':>7}", flush=True)  # fmt: skip
    rows: list[Row] = []
    failed = status = 0
    try:
        for n, path in ((n, PATHS[k]) for n in args.tokens for k in args.paths):
            try:
                rows.append(measure(path, shape, n, args.repeats, args.corrupt))
                show(rows[-1])
            except Mismatch as exc:
                print(f"MISMATCH {path.label} at {n} tokens: {exc}", file=sys.stderr, flush=True)
                failed += 1
    except KeyboardInterrupt:
        print("interrupted: the rows so far follow", file=sys.stderr)
        status = 128 + (STOP or [signal.SIGINT])[0]
    for label, mine in by_path(rows).items():
        top = max(mine, key=lambda r: r["tokens"])
        print(f"summary: {label}: {top['ratio_to_memcpy']:.3f}x memcpy at {top['tokens']} tokens")
    plain = {r["tokens"]: r for r in rows if r["path"] == PATHS["slot-write"].label}
    for r in (r for r in rows if r["path"] == PATHS["slot-convert"].label and r["tokens"] in plain):
        print(f"summary: converting into the slot: {r['gbps'] / plain[r['tokens']]['gbps']:.3f}x "
              f"the plain slot write at {r['tokens']} tokens")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot and rows:
        plot(rows, args.plot)
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
