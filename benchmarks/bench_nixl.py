"""NIXL READ throughput between two processes, next to np.copyto of the same bytes in one.

    .venv/bin/python benchmarks/bench_nixl.py            # UCX picks (same host: cma)
    UCX_TLS=tcp .venv/bin/python benchmarks/bench_nixl.py  # emulate a network link

An owner process fills a NixlTransport's staging region; this process reads ranges of it with
`NixlTransport.read` (one descriptor each, into its registered receive arena, released after
each read) for at least --seconds per size. The baseline copies a same-sized numpy array into
another, both already faulted in, in this process. Both are measured in the same run, so the
ratio is what matters on a noisy machine. Not a test.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = [64 << 10, 1 << 20, 64 << 20]
STAGING = (64 << 20) + (1 << 20)


def owner(ready: mp.Queue, done: mp.Queue) -> None:
    from vllm_qaic_connector.transports.nixl import NixlTransport

    transport = NixlTransport(f"bench_owner_{os.getpid()}", STAGING)
    transport.staging.fill_(7)  # fault the pages in, as staged KV would be
    ready.put(transport.endpoint())
    done.get()
    transport.close()


def rate(step: Callable[[], None], nbytes: int, seconds: float) -> tuple[float, float]:
    """(GB/s, microseconds per call) over at least `seconds` and 5 calls, after a warm-up."""
    step()
    calls, start = 0, time.perf_counter()
    while calls < 5 or time.perf_counter() - start < seconds:
        step()
        calls += 1
    elapsed = time.perf_counter() - start
    return nbytes * calls / elapsed / 1e9, elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per size and method")
    parser.add_argument("--notify", action="store_true", help="every read carries a message")
    args = parser.parse_args()

    from vllm_qaic_connector.transports.nixl import NixlTransport

    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=owner, args=(ready, done))
    proc.start()
    reader = NixlTransport(f"bench_reader_{os.getpid()}", STAGING)
    try:
        endpoint = ready.get(timeout=120)
        notify = b"bench" if args.notify else None
        tls = os.environ.get("UCX_TLS", "(UCX default)")
        print(f"UCX_TLS={tls} notify={bool(notify)} cores={os.cpu_count()}")
        print(f"{'bytes':>10} {'nixl GB/s':>10} {'us/read':>10} {'copyto GB/s':>12} {'ratio':>6}")
        for nbytes in SIZES:
            offset = 4096 + 64  # not page aligned, as staged requests need not be

            def read(nbytes: int = nbytes, offset: int = offset) -> None:
                got = reader.read(endpoint, offset, nbytes, notify=notify)
                assert got[0] == 7 and got[-1] == 7
                reader.release_read(endpoint, offset)

            src = np.full(nbytes, 7, dtype=np.uint8)
            dst = np.zeros(nbytes, dtype=np.uint8)

            def copy(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
                np.copyto(dst, src)

            nixl_gbs, us = rate(read, nbytes, args.seconds)
            copy_gbs, _ = rate(copy, nbytes, args.seconds)
            print(
                f"{nbytes:>10} {nixl_gbs:>10.2f} {us:>10.1f} {copy_gbs:>12.2f} "
                f"{nixl_gbs / copy_gbs:>6.2f}"
            )
    finally:
        reader.close()
        done.put(1)
        proc.join(30)


if __name__ == "__main__":
    main()
