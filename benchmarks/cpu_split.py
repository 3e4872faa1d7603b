"""Where each server's CPU goes: CPU ms per request of every process of a setup, under the
closed loop of `compare_e2e.py` (same servers, placement and prompts), read from
``/proc/<pid>/stat`` before and after.

    .venv/bin/python -m benchmarks.cpu_split [--setups aggregated qaic-shm] [--prompts 64]

A process's figure is what the kernel charged it, spinning included (vLLM's CPU worker
polls its message queue for a second after each step), so it is occupancy, not work.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.compare_e2e import ANSWER_TOKENS, copy_prompts, pin, process_cpu, send_all, start
from testbed.live_servers import LiveRun, Server


def cpu_by_process(servers: list[Server]) -> dict[tuple[str, int, str], float]:
    """(server, pid, process name) -> user + system CPU seconds."""
    return {
        (s.name, pid, cpu[0]): cpu[1]
        for s in servers
        for pid in s.pids()
        if (cpu := process_cpu(pid))
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--setups", nargs="+", default=["aggregated", "qaic-shm"])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    for setup in args.setups:
        with LiveRun(f"cpu{setup}") as run:
            url, _, servers = start(setup, run)
            pin(servers)
            warm = [q for q, _ in copy_prompts(2 * args.concurrency, "cpu-split-warm")]
            asyncio.run(send_all(url, warm, args.concurrency, ANSWER_TOKENS))
            prompts = [q for q, _ in copy_prompts(args.prompts, f"cpu-split-{setup}")]
            before, t0 = cpu_by_process(servers), time.monotonic()
            samples = asyncio.run(send_all(url, prompts, args.concurrency, ANSWER_TOKENS))
            wall, after = time.monotonic() - t0, cpu_by_process(servers)
            ttft = sorted(s.ttft for s in samples)[len(samples) // 2]
            print(f"{setup}: {len(prompts) / wall:.1f} req/s, TTFT p50 {1e3 * ttft:.0f} ms")
            spent = {k: v - before.get(k, 0.0) for k, v in after.items()}
            for (server, pid, name), cpu in sorted(spent.items(), key=lambda kv: -kv[1]):
                if cpu:
                    print(f"  {server:<11}{name:<18}{pid:>8}{1e3 * cpu / len(prompts):>8.1f} ms/req"
                          f"{100 * cpu / wall:>6.0f}% of a core")  # fmt: skip


if __name__ == "__main__":
    main()
