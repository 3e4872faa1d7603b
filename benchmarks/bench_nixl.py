"""NIXL READ throughput between two processes, next to np.copyto of the same bytes in one.

    .venv/bin/python benchmarks/bench_nixl.py               # UCX picks (same host: cma)
    UCX_TLS=tcp .venv/bin/python benchmarks/bench_nixl.py   # emulate a network link
    .venv/bin/python benchmarks/bench_nixl.py --only slot --layers 32 --ctx 2048

An owner process fills a NixlTransport's staging region; this process measures, for at least
--seconds per row and method, in the same run (so the ratio is what matters on a noisy
machine):

* NIXL read: ranges of the staging read with `NixlTransport.read` (one descriptor each, into
  its registered receive arena, released after each read).
* NIXL → QAIC slot: the owner also stages one request in ``qaic_slot`` layout (ticket header,
  then per layer the K and V plane ``[1, H, ctx, D]`` of a known pattern). This process
  builds a `SlotTarget` (all KV buffers in POSIX shm, ``[slots, H, ctx, D]``) and pulls
  tokens ``[0, n)`` into slot 1 with `SlotPuller.pull`: header check, ONE transfer with one
  descriptor per merged run straight into the slot, header check again. Checked once first:
  slot 1 must hold exactly the staged bytes for ``[0, n)`` and every other byte of the
  target its sentinel, else the exit status is 1.

The baseline copies a numpy array of the row's bytes into another, both already faulted in,
in this process. Not a test.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch

from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.layout import KVGeometry
from vllm_qaic_connector.protocol.wire import TransportEndpoint
from vllm_qaic_connector.qaic.slot_pull import SlotPuller
from vllm_qaic_connector.qaic.target import BufferSpec, Manifest, SlotTarget
from vllm_qaic_connector.region_headers import HEADER_BYTES, seal
from vllm_qaic_connector.transports.nixl import NixlTransport

SIZES = [64 << 10, 1 << 20, 64 << 20, 256 << 20]
STAGING = (256 << 20) + (1 << 20)  # the NIXL read rows; the staged slot request follows it
GENERATION = 0x5EED_0001  # the staged request's ticket (any non-zero value)
SEED = 20240611  # both processes derive the staged KV bytes from it
SENTINEL = 0xA5  # every target byte a pull must not write
SLOT_LABEL = "NIXL → QAIC slot"


@dataclass(frozen=True)
class SlotShape:
    """The QAIC decode program's KV buffers: per layer K and V of ``[slots, H, ctx, D]``."""

    layers: int
    heads: int
    head_dim: int
    ctx: int
    dtype: str
    slots: int

    @property
    def geometry(self) -> KVGeometry:
        return KVGeometry(self.heads, self.head_dim, self.ctx, getattr(torch, self.dtype))

    @property
    def staged(self) -> StagingFormat:
        return StagingFormat("qaic_slot", self.geometry, self.layers)

    @property
    def request_bytes(self) -> int:
        """One staged request, header included (a full slot, whatever its token count)."""
        return HEADER_BYTES + self.staged.request_bytes(self.ctx)

    def manifest(self) -> Manifest:
        shape = (self.slots, self.heads, self.ctx, self.head_dim)
        names = [
            f"past_{kv}.{i}_RetainedState" for i in range(self.layers) for kv in ("key", "value")
        ]
        return Manifest([[BufferSpec(name, shape, self.dtype) for name in names]])


def pattern(nbytes: int) -> torch.Tensor:
    """The staged request's KV bytes, the same in both processes."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def owner(ready: mp.Queue, done: mp.Queue, shape: SlotShape) -> None:
    transport = NixlTransport(f"bench_owner_{os.getpid()}", STAGING + shape.request_bytes)
    staging = transport.staging
    staging[:STAGING].fill_(7)  # fault the pages in, as staged KV would be
    staging[STAGING + HEADER_BYTES :].copy_(pattern(shape.request_bytes - HEADER_BYTES))
    seal(staging[STAGING : STAGING + HEADER_BYTES], GENERATION)
    ready.put(transport.endpoint())
    done.get()
    transport.close()


def rate(step: Callable[[], object], nbytes: int, seconds: float) -> tuple[float, float]:
    """(GB/s, microseconds per call) over at least `seconds` and 5 calls, after a warm-up."""
    step()
    calls, start = 0, time.perf_counter()
    while calls < 5 or time.perf_counter() - start < seconds:
        step()
        calls += 1
    elapsed = time.perf_counter() - start
    return nbytes * calls / elapsed / 1e9, elapsed / calls * 1e6


def copy_rate(nbytes: int, seconds: float) -> float:
    """np.copyto GB/s of ``nbytes`` between two faulted-in arrays."""
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    return rate(lambda: np.copyto(dst, src), nbytes, seconds)[0]


def read_rows(
    reader: NixlTransport, endpoint: TransportEndpoint, notify: bytes | None, seconds: float
) -> None:
    print(f"{'bytes':>10} {'nixl GB/s':>10} {'us/read':>10} {'copyto GB/s':>12} {'ratio':>6}")
    for nbytes in SIZES:
        offset = 4096 + 64  # not page aligned, as staged requests need not be

        def read(nbytes: int = nbytes, offset: int = offset) -> None:
            got = reader.read(endpoint, offset, nbytes, notify=notify)
            assert got[0] == 7 and got[-1] == 7
            reader.release_read(endpoint, offset)

        nixl_gbs, us = rate(read, nbytes, seconds)
        copy_gbs = copy_rate(nbytes, seconds)
        print(
            f"{nbytes:>10} {nixl_gbs:>10.2f} {us:>10.1f} {copy_gbs:>12.2f} "
            f"{nixl_gbs / copy_gbs:>6.2f}"
        )


def check_slot(
    target: SlotTarget, staged: torch.Tensor, shape: SlotShape, slot: int, n: int
) -> list[str]:
    """Slot ``slot`` holds the staged bytes of tokens ``[0, n)``; every other byte SENTINEL."""
    problems = []
    views = shape.staged.layer_views(staged, shape.ctx)
    for layer, want_kv in enumerate(views):
        for kind, got, want in zip("KV", target.kv(layer), want_kv, strict=True):
            got_b, want_b = got.view(torch.uint8), want[0].view(torch.uint8)
            if not torch.equal(got_b[slot, :, :n], want_b[:, :n]):
                problems.append(f"layer {layer} {kind}: slot {slot} [0, {n}) != staged bytes")
            for s in range(shape.slots):
                rest = got_b[s, :, n:] if s == slot else got_b[s]
                if not bool((rest == SENTINEL).all()):
                    where = f"[{n}, {shape.ctx})" if s == slot else "(another slot)"
                    problems.append(f"layer {layer} {kind}: slot {s} {where} was written")
    return problems


def slot_rows(
    reader: NixlTransport,
    endpoint: TransportEndpoint,
    shape: SlotShape,
    notify: bytes | None,
    seconds: float,
) -> list[str]:
    """Prints the NIXL → QAIC slot rows; returns what the one-off checks found wrong."""
    target_bytes = shape.slots * (shape.request_bytes - HEADER_BYTES)  # a request is one slot
    print(
        f"{SLOT_LABEL}: {shape.layers} layers, {shape.heads} KV heads x {shape.head_dim}, "
        f"ctx {shape.ctx}, {shape.dtype}, pulls into slot 1 of {shape.slots} "
        f"(target {target_bytes / 2**20:.0f} MiB in /dev/shm)"
    )
    print(
        f"{'':<16} {'tokens':>6} {'bytes':>10} {'nixl GB/s':>10} {'us/pull':>10} "
        f"{'descs':>6} {'copyto GB/s':>12} {'ratio':>6}"
    )
    problems: list[str] = []
    staged = pattern(shape.request_bytes - HEADER_BYTES)
    target = SlotTarget(shape.manifest(), f"qaic_kv_bench{os.getpid()}", None)
    puller: SlotPuller | None = None
    try:
        puller = SlotPuller(target, reader)
        slot = [target.allocate_slot() for _ in range(2)][1]
        for n in sorted({shape.ctx // 2, shape.ctx}):
            for layer in range(shape.layers):
                for buffer in target.kv(layer):
                    buffer.view(torch.uint8).fill_(SENTINEL)  # also faults the pages in

            def pull(n: int = n, puller: SlotPuller = puller) -> int:
                runs = puller.pull(slot, endpoint, STAGING, shape.geometry, n, GENERATION, notify)
                return len(runs)

            runs = puller.pull(slot, endpoint, STAGING, shape.geometry, n, GENERATION, notify)
            problems += check_slot(target, staged, shape, slot, n)
            nbytes = sum(r.nbytes for r in runs)
            nixl_gbs, us = rate(pull, nbytes, seconds)
            copy_gbs = copy_rate(nbytes, seconds)
            print(
                f"{SLOT_LABEL:<16} {n:>6} {nbytes:>10} {nixl_gbs:>10.2f} {us:>10.1f} "
                f"{len(runs):>6} {copy_gbs:>12.2f} {nixl_gbs / copy_gbs:>6.2f}"
            )
    finally:
        if puller is not None:
            puller.close()
        target.close()
    return problems


def _exit_on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # runs the finally blocks: no shm segments left behind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per row and method")
    parser.add_argument("--notify", action="store_true", help="every read carries a message")
    parser.add_argument("--only", choices=["read", "slot"], help="run only these rows")
    slot = parser.add_argument_group("NIXL → QAIC slot (the decode program's KV buffers)")
    slot.add_argument("--layers", type=int, default=16)
    slot.add_argument("--kv-heads", type=int, default=8)
    slot.add_argument("--head-dim", type=int, default=128)
    slot.add_argument("--ctx", type=int, default=1024, help="tokens per slot")
    slot.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    slot.add_argument("--slots", type=int, default=4)
    args = parser.parse_args()
    shape = SlotShape(args.layers, args.kv_heads, args.head_dim, args.ctx, args.dtype, args.slots)
    if min(shape.layers, shape.heads, shape.head_dim) < 1 or shape.ctx < 2 or shape.slots < 2:
        parser.error("need layers, heads, head_dim >= 1, ctx >= 2 and slots >= 2")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)

    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=owner, args=(ready, done, shape))
    proc.start()
    reader = NixlTransport(f"bench_reader_{os.getpid()}", STAGING)
    problems: list[str] = []
    try:
        endpoint = ready.get(timeout=120)
        notify = b"bench" if args.notify else None
        tls = os.environ.get("UCX_TLS", "(UCX default)")
        print(f"UCX_TLS={tls} notify={bool(notify)} cores={os.cpu_count()}")
        if args.only in (None, "read"):
            read_rows(reader, endpoint, notify, args.seconds)
        if args.only in (None, "slot"):
            problems = slot_rows(reader, endpoint, shape, notify, args.seconds)
    finally:
        reader.close()
        done.put(1)
        proc.join(30)
    for problem in problems:
        print(f"MISMATCH: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
