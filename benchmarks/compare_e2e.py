"""End to end, one run: aggregated vLLM, this connector (shm, NIXL, and 128 -> 32 blocks) and
vLLM's NixlConnector (CPU host buffer), 1P1D on the shipped model, same prompts.

    make compare                                   # 64 prompts, concurrency 8 and 1
    .venv/bin/python -m benchmarks.compare_e2e --quick --json out.json --plot out.png

Each setup gets its own real servers (every thread of the prefill on core 0, of the decode
on core 1, the proxy in front and this client on core 1; aggregated: one server on core 0),
started, warmed with two requests, measured, stopped. Per setup and concurrency it prints
TTFT p50/p95 (first streamed text), the prefill leg's p50 within it (the proxy's
Server-Timing header), TPOT, agreement with the aggregated answers, correct copies, stalls
(TTFT over 5 s), the servers' CPU seconds per request, and ratios: TTFT p50 to aggregated
and to NixlConnector's. Then prefill throughput with the connector (max_tokens 1,
``do_remote_decode``) against the aggregated server on the same prompts, and on the
connector's prefill server alone, staged against plain prefills in alternating rounds
(servers minutes apart drift by more than the connector costs).
Targets (issue #13) are printed as met or not; nothing is asserted on time.
Exit status 1 if any answer of this connector disagrees with the aggregated one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import requests

from testbed.live_servers import (
    ANSWER_TOKENS,
    LiveRun,
    Server,
    Streamed,
    copy_prompts,
    free_port,
    kv_config,
    metric_samples,
    stream_completion,
    wait_all_ready,
)

STALL_S = 5.0
SETUPS = ("aggregated", "qaic-shm", "qaic-nixl", "nixl-connector", "qaic-shm-128to32")


@dataclass
class Row:
    setup: str
    concurrency: int  # 0: open loop, requests arriving at ``arrivals_per_s``
    arrivals_per_s: float
    requests: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    prefill_p50_ms: float  # the proxy's prefill leg, within TTFT (nan: no proxy)
    tpot_ms: float
    rest_ms: float  # mean time from the first token to the last
    agreement: float  # same text as the aggregated server's
    correct: float  # the copy task's answer
    stalls: int
    cpu_s_per_request: float
    errors: int
    # Means from the answering engine's /metrics (a P/D setup's decode), see ENGINE_TIMES.
    queued_ms: float = float("nan")
    first_step_ms: float = float("nan")
    kv_load_ms: float = float("nan")


# The answering engine's own account of a request's first token: time queued (for a P/D
# decode, the wait for its KV included), its first step, and this connector's load.
ENGINE_TIMES = {
    "queued_ms": "vllm:request_queue_time_seconds",
    "first_step_ms": "vllm:request_prefill_time_seconds",
    "kv_load_ms": "vllm:qaic_kv_load_seconds",
}
Totals = dict[str, tuple[float, float]]


def engine_totals(url: str) -> Totals:
    """(sum, count) of each ENGINE_TIMES histogram on ``url``'s /metrics, all labels."""
    text = requests.get(f"{url}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(v for _, v in metric_samples(text, name))

    return {k: (total(f"{n}_sum"), total(f"{n}_count")) for k, n in ENGINE_TIMES.items()}


def with_engine_means(row: Row, before: Totals, after: Totals) -> Row:
    """``row`` with the mean ms per request between two `engine_totals` (nan: none)."""
    means = {}
    for field, (s1, n1) in after.items():
        s0, n0 = before[field]
        means[field] = round((s1 - s0) / (n1 - n0) * 1e3, 2) if n1 > n0 else float("nan")
    return replace(row, **means)  # type: ignore[arg-type]  # ENGINE_TIMES: Row's float fields


async def send_all(
    url: str, prompts: list[str], concurrency: int, max_tokens: int, arrivals_per_s: float = 0.0
) -> list[Streamed]:
    """At most ``concurrency`` requests in flight or, with ``arrivals_per_s``, requests sent
    at seeded Poisson arrival times whatever is in flight (open loop)."""
    sem = asyncio.Semaphore(concurrency or len(prompts))
    gaps = random.Random(0)
    starts = [0.0] * len(prompts)
    if arrivals_per_s:
        starts = list(itertools.accumulate(gaps.expovariate(arrivals_per_s) for _ in prompts))
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def limited(p: str, start: float) -> Streamed:
            await asyncio.sleep(start)
            async with sem:
                return await stream_completion(session, url, p, max_tokens)

        return await asyncio.gather(*(limited(p, t) for p, t in zip(prompts, starts, strict=True)))


def process_cpu(pid: int) -> tuple[str, float] | None:
    """A live process's name and user + system CPU seconds; None once it has ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    utime, stime = stat.rsplit(")", 1)[1].split()[11:13]  # in clock ticks
    return stat[stat.index("(") + 1 : stat.rindex(")")], (int(utime) + int(stime)) / 100.0


def cpu_seconds(servers: list[Server]) -> float:
    """user + system CPU seconds of every live process of ``servers``."""
    return sum(cpu[1] for s in servers for pid in s.pids() if (cpu := process_cpu(pid)))


def start(
    setup: str,
    run: LiveRun,
    extra: dict[str, Any] | None = None,
    prefill_args: tuple[str, ...] = (),
    server_args: tuple[str, ...] = (),
    wait: bool = True,
) -> tuple[str, str | None, list[Server]]:
    """Servers of ``setup``: (URL to ask, the prefill's URL or None, every server);
    ``extra``: this connector's extra config; ``prefill_args``: every prefill server's;
    ``server_args``: every vLLM server's; ``wait``: until they are ready."""
    every, prefill = list(server_args), [*server_args, *prefill_args]
    if setup == "aggregated":
        agg = run.vllm("aggregated", "0", None, extra_args=every)
        if wait:
            wait_all_ready(agg, retries=1)
        return agg.url, None, [agg]
    if setup == "nixl-connector":
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        ports = [free_port(), free_port()]
        p, d = (
            run.vllm(
                name,
                core,
                kv,
                extra_args=args,
                extra_env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)},
            )
            for name, core, port, args in (
                ("prefill", "0", ports[0], prefill),
                ("decode", "1", ports[1], every),
            )
        )
        proxy = run.proxy([p.url], [d.url])
    else:
        transport = "nixl" if setup == "qaic-nixl" else "shm"
        decode_block = ["--block-size", "32"] if setup.endswith("128to32") else []
        p_kv = kv_config("kv_producer", run.engine_id("p"), 0, transport, **(extra or {}))
        p = run.vllm("prefill", "0", p_kv, extra_args=prefill)
        d_kv = kv_config("kv_consumer", run.engine_id("d"), free_port(), transport, **(extra or {}))
        d = run.vllm("decode", "1", d_kv, extra_args=every + decode_block)
        proxy = run.proxy([p.url], [d.url], [d.side_channel])
    if wait:
        wait_all_ready(p, d, proxy, retries=1)
    return proxy.url, p.url, [p, d, proxy]


def summarize(setup: str, conc: int, arrivals: float, samples: list[Streamed],
              ref: list[str] | None, answers: list[str], cpu_s: float) -> Row:  # fmt: skip
    ok = [s for s in samples if not s.error]
    ttft = sorted(s.ttft for s in ok) or [float("nan")]
    tpot = [(s.seconds - s.ttft) / (s.chunks - 1) for s in ok if s.chunks > 1]
    prefill = [s.prefill_s for s in ok]
    texts = [s.text for s in samples]
    same = sum(t == r for t, r in zip(texts, ref or texts, strict=True))
    from testbed.copy_task import is_correct

    return Row(
        setup, conc, arrivals, len(samples),
        round(statistics.median(ttft) * 1e3, 1),
        round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))] * 1e3, 1),
        round(statistics.median(prefill) * 1e3, 1) if prefill else float("nan"),
        round(statistics.median(tpot) * 1e3, 2) if tpot else float("nan"),
        round(statistics.mean(s.seconds - s.ttft for s in ok) * 1e3, 1) if ok else float("nan"),
        round(same / len(samples), 3),
        round(sum(is_correct(t, a) for t, a in zip(texts, answers, strict=True)) / len(samples), 3),
        sum(s.ttft > STALL_S or s.error != "" for s in samples),
        round(cpu_s / len(samples), 3),
        len(samples) - len(ok),
    )  # fmt: skip


def prefill_rate(url: str, prompts: list[str], staged: bool) -> float:
    """Requests per second of ``max_tokens=1`` prefills at concurrency 8 (``staged``: with
    ``do_remote_decode``, so the connector saves each prompt's KV)."""

    async def go() -> float:
        extra = {"kv_transfer_params": {"do_remote_decode": True}} if staged else {}
        sem = asyncio.Semaphore(8)
        async with aiohttp.ClientSession() as session:

            async def post(p: str) -> None:
                body = {"model": "model", "prompt": p, "max_tokens": 1, **extra}
                async with sem, session.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()

            t0 = time.monotonic()
            await asyncio.gather(*(post(p) for p in prompts))
            return len(prompts) / (time.monotonic() - t0)

    return asyncio.run(go())


RATE_ROUNDS = 5


def alternated_rates(url: str, prompts: list[str]) -> list[float]:
    """On one prefill server, staged / plain prefill rate ratios of `RATE_ROUNDS` rounds,
    the order flipped each round (drift cancels). Every run gets the same prompts with its
    own filler word after ``<bos>``, so none is a prefix-cache hit of another."""
    ratios = []
    for r in range(RATE_ROUNDS):
        rates = {}
        for i, staged in enumerate((True, False) if r % 2 == 0 else (False, True)):
            variant = [p.replace("<bos>", f"<bos> f{2 * r + i}", 1) for p in prompts]
            rates[staged] = prefill_rate(url, variant, staged)
        ratios.append(rates[True] / rates[False])
    return ratios


def pin(servers: list[Server], front: int = 1) -> None:
    """vLLM binds only its OpenMP threads to its core (``VLLM_CPU_OMP_THREADS_BIND``); its
    API server and engine core would float onto the other core (the aggregated server's
    engine core spun there at 88% of a core). Every thread of a server goes on its core;
    the proxy and this client on ``front``: by default core 1, away from core 0, where the
    aggregated server or the prefill runs (the prefill's core limits a P/D setup's rate)."""
    if not {0, 1} <= os.sched_getaffinity(0):
        return  # not the two-core host this is laid out for
    os.sched_setaffinity(0, {front})
    for s in servers:
        core = int(s.env.get("VLLM_CPU_OMP_THREADS_BIND", str(front)))  # the proxy: none
        tids = (t for pid in s.pids() for t in os.listdir(f"/proc/{pid}/task"))
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended
                os.sched_setaffinity(int(tid), {core})


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 1])
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument(
        "--quick",
        action="store_true",
        help="8 prompts at concurrency 4 and open loop, then 2 paired rounds: aggregated\n"
        "and qaic-shm-128to32 (what CI runs)",
    )
    p.add_argument(
        "--open-loop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also send every setup the prompts at one arrival rate (Poisson): the aggregated\n"
        "server's throughput at the highest concurrency. Closed loop, a setup that decodes\n"
        "faster gets its next requests sooner, so its TTFT is taken at a higher load.",
    )
    p.add_argument(
        "--prefill-args",
        type=lambda s: tuple(shlex.split(s)),
        default=(),
        help='more vllm serve arguments for every prefill server, e.g. "--max-num-seqs 2"',
    )
    p.add_argument(
        "--server-args",
        type=lambda s: tuple(shlex.split(s)),
        default=(),
        help='more vllm serve arguments for every server, e.g. "--dtype float32"',
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pin every server's threads to its core, the proxy and this client to core 1",
    )
    p.add_argument(
        "--front-core",
        type=int,
        choices=(0, 1),
        default=1,
        help="the core of the proxy and this client (default 1, the decode's)",
    )
    p.add_argument(
        "--paired",
        type=int,
        metavar="ROUNDS",
        default=0,
        help="keep every setup's servers up (mind the memory: 2-3 GiB a server), then\n"
        "ROUNDS rounds of fresh prompts at the highest concurrency through each, the\n"
        "order flipped each round: each round's TTFT p50 ratio to aggregated and their\n"
        "median, without the drift between setups measured minutes apart (--quick: 2)",
    )
    p.add_argument("--sync-saves", action="store_true", help="this connector with async_saves off")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    args = p.parse_args(argv)  # fmt: skip
    if args.quick:
        args.prompts, args.concurrency = 8, [4]
        args.setups = ["aggregated", "qaic-shm-128to32"]
        args.paired = args.paired or 2
    if "aggregated" not in args.setups:
        args.setups.insert(0, "aggregated")  # the reference answers and times
    return args


def paired_rounds(args: argparse.Namespace, urls: dict[str, str]) -> int:
    """Runs minutes apart drift by more than the c=8 target's margin (the aggregated row
    read 110-154 ms in six runs here): each P/D setup against the aggregated server round
    by round, every server up and idle while another is measured, the order flipped each
    round. Returns the answers that differ from the aggregated server's, or failed."""
    setups, conc = [s for s in urls if s != "aggregated"], max(args.concurrency)
    ratios: dict[str, list[float]] = {s: [] for s in setups}
    disagreements = 0
    for r in range(args.paired):
        prompts = [p for p, _ in copy_prompts(args.prompts, f"compare-paired-{r}")]
        order = ["aggregated", *setups]
        samples = {
            s: asyncio.run(send_all(urls[s], prompts, conc, ANSWER_TOKENS))
            for s in (order if r % 2 == 0 else order[::-1])
        }
        p50 = {s: statistics.median(x.ttft for x in v) for s, v in samples.items()}
        for s in setups:
            ratios[s].append(p50[s] / p50["aggregated"])
            texts = zip(samples[s], samples["aggregated"], strict=True)
            disagreements += sum(a.text != b.text or bool(a.error) for a, b in texts)
        print(f"[compare] paired round {r}: TTFT p50 " + ", ".join(
            f"{s} {v * 1e3:.0f} ms" for s, v in p50.items()), flush=True)  # fmt: skip
    print(f"\npaired, c={conc}, {args.prompts} fresh prompts a round: TTFT p50 / aggregated's")
    for s, v in ratios.items():
        rounds = " ".join(f"{x:.2f}" for x in v)
        print(f"  {s}: median {statistics.median(v):.2f} (rounds {rounds})")
    print(f"  answers differing from the aggregated server's, or failed: {disagreements}")
    return disagreements


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # Fresh prompts per concurrency (and for warming up and the prefill rate): a prompt a
    # server has seen would be a prefix-cache hit, on both sides of a handoff.
    sets = {c: copy_prompts(args.prompts, f"compare-e2e-{c}") for c in args.concurrency}
    if args.open_loop:
        sets[0] = copy_prompts(args.prompts, "compare-e2e-open")
    arrivals = 0.0  # the aggregated server's requests/s at the highest concurrency
    warm = [p for p, _ in copy_prompts(2 * max(args.concurrency), "compare-e2e-warm")]
    rate_prompts = [p for p, _ in copy_prompts(args.prompts, "compare-e2e-rate")]
    rows: list[Row] = []
    ref: dict[int, list[str]] = {}
    rates: dict[str, float] = {}
    same_server: list[float] = []  # staged / plain, round by round
    urls, runs, disagreements = {}, [], 0
    extra = {"async_saves": False} if args.sync_saves else None
    with contextlib.ExitStack() as kept:  # --paired: every setup's servers, to the end
        # --paired: all of them start at once (a minute sooner), then each is measured
        # while the others idle.
        started: dict[str, tuple[LiveRun, tuple[str, str | None, list[Server]]]] = {}
        for setup in args.setups if args.paired else ():
            run = kept.enter_context(LiveRun(f"cmp{setup}"))
            runs.append((setup, run))
            started[setup] = run, start(setup, run, extra, args.prefill_args,
                                        args.server_args, wait=False)  # fmt: skip
        if started:
            t0 = time.monotonic()
            wait_all_ready(*(s for _, (*_, servers) in started.values() for s in servers),
                           retries=1)  # fmt: skip
            took = time.monotonic() - t0
            print(f"[compare] {', '.join(started)}: ready in {took:.0f}s", flush=True)
        for setup in args.setups:
            with contextlib.ExitStack() as this_setup:
                if setup in started:
                    run, (url, prefill_url, servers) = started[setup]
                else:
                    t0 = time.monotonic()
                    run = this_setup.enter_context(LiveRun(f"cmp{setup}"))
                    runs.append((setup, run))
                    url, prefill_url, servers = start(
                        setup, run, extra, args.prefill_args, args.server_args
                    )
                    print(f"[compare] {setup}: ready in {time.monotonic() - t0:.0f}s", flush=True)
                urls[setup] = url
                if args.pin:
                    pin(servers, args.front_core)
                # Warm at the highest concurrency: a first batch of new shape is several
                # times slower on vLLM's CPU backend, and a P/D pair has two engines to warm.
                asyncio.run(send_all(url, warm, max(args.concurrency), ANSWER_TOKENS))
                for conc, pairs in sets.items():
                    prompts, answers = [p for p, _ in pairs], [a for _, a in pairs]
                    answering = servers[1] if prefill_url else servers[0]  # a P/D's decode
                    totals, cpu0 = engine_totals(answering.url), cpu_seconds(servers)
                    t1 = time.monotonic()
                    per_s = 0.0 if conc else arrivals
                    samples = asyncio.run(send_all(url, prompts, conc, ANSWER_TOKENS, per_s))
                    cpu = cpu_seconds(servers) - cpu0
                    if setup == "aggregated":
                        ref[conc] = [s.text for s in samples]
                        if conc == max(args.concurrency):
                            arrivals = round(len(prompts) / (time.monotonic() - t1), 2)
                    row = summarize(setup, conc, per_s, samples, ref.get(conc), answers, cpu)
                    row = with_engine_means(row, totals, engine_totals(answering.url))
                    rows.append(row)
                    print(f"[compare] {rows[-1]}", flush=True)
                if setup == "aggregated":
                    rates[setup] = prefill_rate(url, rate_prompts, staged=False)
                elif setup == "qaic-shm" or (args.quick and setup.startswith("qaic")):
                    assert prefill_url is not None
                    rates["connector"] = prefill_rate(prefill_url, rate_prompts, staged=True)
                    same_server = alternated_rates(prefill_url, rate_prompts)
        if args.paired:
            disagreements = paired_rounds(args, urls)
    for setup, run in runs:
        if run.report is not None and not run.report.clean:
            print(f"[compare] {setup} left things behind: {run.report.problems()}", flush=True)
    report_rows(rows, rates, same_server)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.plot:
        plot(rows, args.plot)
    ours = [r for r in rows if r.setup.startswith("qaic")]
    return 1 if disagreements or any(r.agreement < 1.0 or r.errors for r in ours) else 0


def ms(value: float, digits: int = 0) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}ms"


def load(row: Row) -> str:
    return f"c={row.concurrency}" if row.concurrency else f"{row.arrivals_per_s:.1f} req/s"


def report_rows(rows: list[Row], rates: dict[str, float], same_server: list[float]) -> None:
    by = {(r.setup, r.concurrency): r for r in rows}
    print(f"\n{'setup':<18}{'load':>11}{'TTFT p50':>10}{'p95':>9}{'prefill':>9}{'TPOT':>8}"
          f"{'agree':>7}{'correct':>8}{'stalls':>7}{'CPU s/req':>10}"
          f"{'x agg':>7}{'x nixl':>8}")  # fmt: skip
    for r in rows:
        agg = by.get(("aggregated", r.concurrency))
        nixl = by.get(("nixl-connector", r.concurrency))
        x_agg = r.ttft_p50_ms / agg.ttft_p50_ms if agg else float("nan")
        x_nixl = r.ttft_p50_ms / nixl.ttft_p50_ms if nixl else float("nan")
        print(f"{r.setup:<18}{load(r):>11}{r.ttft_p50_ms:>8.0f}ms{r.ttft_p95_ms:>7.0f}ms"
              f"{ms(r.prefill_p50_ms):>9}{r.tpot_ms:>6.1f}ms{r.agreement:>7.0%}{r.correct:>8.0%}"
              f"{r.stalls:>7}{r.cpu_s_per_request:>10.3f}{x_agg:>7.2f}{x_nixl:>8.2f}")  # fmt: skip
    print("\nthe answering engine's first token (means from its /metrics; a P/D decode's "
          "time queued includes the wait for its KV)")  # fmt: skip
    print(f"{'setup':<18}{'load':>11}{'queued':>9}{'1st step':>9}{'KV load':>9}")
    for r in rows:
        print(f"{r.setup:<18}{load(r):>11}{ms(r.queued_ms, 1):>9}{ms(r.first_step_ms, 1):>9}"
              f"{ms(r.kv_load_ms, 2):>9}")  # fmt: skip
    print("\ntargets (issue #13): TTFT p50 <= 2x aggregated, <= 0.5x NixlConnector, "
          "p95 <= 3x p50, 0 stalls")  # fmt: skip
    for r in rows:
        if not r.setup.startswith("qaic"):
            continue
        agg = by.get(("aggregated", r.concurrency))
        nixl = by.get(("nixl-connector", r.concurrency))
        checks = {  # None: its reference setup did not run
            "<=2x agg": None if agg is None else r.ttft_p50_ms <= 2 * agg.ttft_p50_ms,
            "<=0.5x nixl": None if nixl is None else r.ttft_p50_ms <= 0.5 * nixl.ttft_p50_ms,
            "p95<=3x p50": r.ttft_p95_ms <= 3 * r.ttft_p50_ms,
            "0 stalls": r.stalls == 0,
        }
        words = {None: "not run", True: "met", False: "NOT met"}
        flags = " ".join(f"{k}:{words[v]}" for k, v in checks.items())
        print(f"  {r.setup} {load(r)}: {flags}")
    floor_lines(rows, rates.get("connector"))
    if "aggregated" in rates and "connector" in rates:
        ratio = rates["connector"] / rates["aggregated"]
        print(f"prefill throughput with the connector: {rates['connector']:.1f} req/s, without: "
              f"{rates['aggregated']:.1f} req/s, ratio {ratio:.2f} (target >= 0.9)")  # fmt: skip
    if same_server:
        rounds = " ".join(f"{r:.2f}" for r in same_server)
        print(f"the same on the connector's prefill server, staged / plain prefills alternated: "
              f"median ratio {statistics.median(same_server):.2f} (rounds {rounds})")  # fmt: skip


def floor_lines(rows: list[Row], rate: float | None) -> None:
    """Closed loop, c requests always in flight: c = throughput x (mean TTFT + mean time
    after the first token), and throughput cannot pass the prefill's own rate. So a P/D
    setup's mean TTFT cannot go below c / rate - time after the first token, however fast
    the handoff: a decode that answers sooner sends the next prompt to the prefill sooner."""
    if not rate:
        return
    by = {(r.setup, r.concurrency): r for r in rows}
    print(f"closed-loop floor of a P/D setup's mean TTFT with the prefill at most {rate:.1f} "
          "req/s (Little's law: concurrency / rate - time after the first token)")  # fmt: skip
    for r in rows:
        if r.setup.startswith("qaic") and r.concurrency:
            floor = 1e3 * r.concurrency / rate - r.rest_ms
            agg = by.get(("aggregated", r.concurrency))
            twice = f", 2x aggregated {2 * agg.ttft_p50_ms:.0f} ms" if agg else ""
            print(f"  {r.setup} {load(r)}: floor {max(floor, 0):.0f} ms (after the first token "
                  f"{r.rest_ms:.0f} ms), measured p50 {r.ttft_p50_ms:.0f} ms{twice}")  # fmt: skip


def plot(rows: list[Row], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = sorted({r.concurrency for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(concs), figsize=(6 * len(concs), 4), squeeze=False)
    for ax, conc in zip(axes[0], concs, strict=True):
        mine = [r for r in rows if r.concurrency == conc]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r.ttft_p50_ms for r in mine], 0.4, label="TTFT p50")
        ax.bar([x + 0.2 for x in xs], [r.ttft_p95_ms for r in mine], 0.4, label="TTFT p95")
        ax.set_xticks(list(xs), [r.setup for r in mine], rotation=20, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(load(mine[0]))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    sys.exit(main())
