"""Soak for issue #9: many handoffs through 1P1D + proxy, with hostile input and aborts.

    .venv/bin/python -m testbed.soak --requests 500 --concurrency 16 --transport shm|nixl

Starts a prefill (core 0), a decode (core 1, kv_load_failure_policy=recompute) and the proxy
(testbed/live_servers.py), then sends copy-task prompts with known answers at the given
concurrency: most through the proxy; ~2% hostile (staged on the prefill, then sent straight
to the decode with broken params, see ``hostile_variants``: they must still answer right,
by recompute); ~2% aborted by the client ~50 ms after sending. Progress every ~50 requests,
then one summary and its gates; the exit code is non-zero when a gate fails:

- no wrong answer (HTTP 200 with a wrong answer), no error and no stall (a request slower
  than --stall-s) among the requests that were not aborted;
- the prefill's staging pages in use back to 0 after the run (polled, bounded; the prefill
  is sent a plain request every few seconds: hostile requests' leases may end after it
  stopped stepping);
- each server's RSS at the end <= RSS after warm-up * --rss-factor + --rss-slack-mib;
- after stopping: no process of the run left, no new /dev/shm object (qaic_kv_* of this
  run's engines are never removed by the soak; vLLM's own leftovers are, as the harness does).

Latency is the client's, end to end through the proxy (the proxy does not stream, so the
client sees no first token); TTFT is the servers' own histogram (decode: arrival to first
token, KV load included), as bucket upper bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import aiohttp
import requests

from testbed.live_servers import (
    LiveRun,
    VllmServer,
    completion_body,
    copy_prompts,
    free_port,
    histogram,
    histogram_quantile,
    hostile_variants,
    kv_config,
    outcome,
    poll_until,
    wait_all_ready,
)

PAGES_IN_USE = "vllm:qaic_kv_staging_pages_in_use"
TTFT = "vllm:time_to_first_token_seconds"
MIB = 1 << 20


@dataclass
class Tally:
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)  # good requests, seconds
    stalls: list[tuple[str, float]] = field(default_factory=list)
    first_problems: list[str] = field(default_factory=list)
    done: int = 0

    def add(self, kind: str, verdict: str) -> None:
        counts = self.by_kind.setdefault(kind, {})
        counts[verdict] = counts.get(verdict, 0) + 1

    def count(self, verdict: str, kinds: tuple[str, ...] = ("good", "hostile")) -> int:
        return sum(self.by_kind.get(k, {}).get(verdict, 0) for k in kinds)

    def problem(self, text: str) -> None:
        if len(self.first_problems) < 5:
            self.first_problems.append(text)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """(status, JSON object) like live_servers.complete; status 0 when no HTTP answer."""
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return 0, {"connection_error": f"{type(exc).__name__}: {exc}"}
    try:
        payload = json.loads(text)
    except ValueError:
        return status, {"not_json": text[:300]}
    return status, payload if isinstance(payload, dict) else {"not_json": text[:300]}


class Soak:
    def __init__(
        self, args: argparse.Namespace, prefill: VllmServer, decode: VllmServer, proxy_url: str
    ) -> None:
        self.args, self.prefill, self.decode, self.proxy_url = args, prefill, decode, proxy_url
        self.tally = Tally()
        self.t0 = time.monotonic()
        self.label = "soak"
        self.planned = 0
        self.closed_port = free_port()

    async def one(self, session: aiohttp.ClientSession, i: int, kind: str, p: str, a: str) -> None:
        t0 = time.monotonic()
        if kind == "abort":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(post(session, self.proxy_url, completion_body(p)), 0.05)
                self.tally.add(kind, "finished_before_abort")
                return
            self.tally.add(kind, "aborted")
            return
        if kind == "hostile":
            status, staged = await post(
                session,
                self.prefill.url,
                completion_body(p, 1, {"do_remote_decode": True}),
            )
            params = staged.get("kv_transfer_params")
            if status != 200 or not isinstance(params, dict) or params.get("error"):
                self.tally.add(kind, "error")
                self.tally.problem(f"#{i} hostile: staging failed: {status} {str(staged)[:200]}")
                return
            variants = hostile_variants(params, self.closed_port)
            name = sorted(variants)[i % len(variants)]
            kind_label = f"hostile[{name}]"
            status, body = await post(
                session, self.decode.url, completion_body(p, params=variants[name])
            )
        else:
            kind_label = "good"
            status, body = await post(session, self.proxy_url, completion_body(p))
        seconds = time.monotonic() - t0
        verdict = outcome(status, body, a)
        self.tally.add(kind, verdict)
        if kind == "good" and verdict == "correct":
            self.tally.latencies.append(seconds)
        if verdict != "correct":
            self.tally.problem(f"#{i} {kind_label}: {verdict} HTTP {status} {str(body)[:200]}")
        if seconds > self.args.stall_s:
            self.tally.stalls.append((f"#{i} {kind_label}", round(seconds, 1)))

    def progress(self) -> None:
        t = self.tally
        print(
            f"[{self.label}] {t.done}/{self.planned} elapsed={time.monotonic() - self.t0:.0f}s "
            f"correct={t.count('correct')} wrong={t.count('wrong')} "
            f"errors={t.count('error') + t.count('unclean') + t.count('aborted')} "
            f"aborted={t.count('aborted', ('abort',))} stalls={len(t.stalls)} "
            f"latency_p50={percentile(t.latencies, 0.5):.2f}s "
            f"pages_in_use={self.prefill.metric(PAGES_IN_USE, 0.0):.0f}",
            flush=True,
        )

    async def drive(self, plan: list[tuple[str, str, str]]) -> None:
        self.planned = len(plan)
        sem = asyncio.Semaphore(self.args.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.args.timeout)
        connector = aiohttp.TCPConnector(limit=0)

        async def guarded(session: aiohttp.ClientSession, i: int) -> None:
            kind, p, a = plan[i]
            async with sem:
                await self.one(session, i, kind, p, a)
            self.tally.done += 1
            if self.tally.done % 50 == 0 or self.tally.done == len(plan):
                await asyncio.to_thread(self.progress)

        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await asyncio.gather(*(guarded(session, i) for i in range(len(plan))))


def make_plan(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(kind, prompt, answer) per request; kind is good, hostile or abort."""
    rng = random.Random(f"soak-{args.seed}")
    n = args.requests
    n_hostile = max(1, round(n * args.hostile_frac)) if args.hostile_frac > 0 else 0
    n_abort = max(1, round(n * args.abort_frac)) if args.abort_frac > 0 else 0
    special = rng.sample(range(n), min(n, n_hostile + n_abort))
    kinds = ["good"] * n
    for j, i in enumerate(special):
        kinds[i] = "hostile" if j < n_hostile else "abort"
    prompts = copy_prompts(n, f"soak-{args.seed}")
    return [(k, p, a) for k, (p, a) in zip(kinds, prompts, strict=True)]


def run_soak(args: argparse.Namespace) -> int:
    gates: list[str] = []
    lines: list[str] = []
    t_start = time.monotonic()
    run = LiveRun(f"soak{args.transport}")
    try:
        extra = {"lease_s": args.lease_s}
        prefill = run.vllm(
            "prefill",
            "0",
            kv_config("kv_producer", run.engine_id("p"), free_port(), args.transport, **extra),
        )
        decode = run.vllm(
            "decode",
            "1",
            kv_config("kv_consumer", run.engine_id("d"), free_port(), args.transport),
        )
        proxy = run.proxy([prefill.url], [decode.url], [decode.side_channel])
        ready = wait_all_ready(prefill, decode, proxy, retries=1)
        print(f"[soak] servers ready {ready} in {run.dir}", flush=True)
        servers = {"prefill": prefill, "decode": decode, "proxy": proxy}

        warm = copy_prompts(args.concurrency, f"soak-warm-{args.seed}")
        soak = Soak(args, prefill, decode, proxy.url)
        soak.label = "soak warm-up"
        asyncio.run(soak.drive([("good", p, a) for p, a in warm]))
        if soak.tally.count("correct") != len(warm):
            gates.append(f"warm-up: {soak.tally.first_problems[:2]}")
        rss_start = {name: s.rss() for name, s in servers.items()}
        ttft0 = {
            name: histogram(s.url, TTFT) for name, s in (("prefill", prefill), ("decode", decode))
        }

        soak = Soak(args, prefill, decode, proxy.url)
        plan = make_plan(args)
        t_run = time.monotonic()
        asyncio.run(soak.drive(plan))
        run_s = time.monotonic() - t_run

        # Staging back to zero: leases of aborted/hostile handoffs run out.
        t_poll = time.monotonic()
        # Hostile requests' tickets are never read: their leases may end after the prefill
        # stopped stepping (STEP_AFTER_STAGING_S past its last handoff), and an idle engine
        # takes no step that would report them gone. A plain request lets it step.
        poke = copy_prompts(1, "soak-poke")[0][0]

        def pages_zero() -> bool:
            if prefill.metric(PAGES_IN_USE, 0.0) == 0:
                return True
            with contextlib.suppress(requests.RequestException):
                body = completion_body(poke, 1)
                requests.post(prefill.url + "/v1/completions", json=body, timeout=30)
            return False

        reached, _ = poll_until(pages_zero, args.lease_s + 30, 2.0)
        pages_end = prefill.metric(PAGES_IN_USE, 0.0)
        pages_s = time.monotonic() - t_poll
        rss_end = {name: s.rss() for name, s in servers.items()}
        ttft = {
            name: (
                histogram_quantile(ttft0[name], histogram(s.url, TTFT), 0.5),
                histogram_quantile(ttft0[name], histogram(s.url, TTFT), 0.95),
            )
            for name, s in (("prefill", prefill), ("decode", decode))
        }
    except BaseException:
        run.keep = True  # the logs say why
        print(f"[soak] aborted: {run.close().summary()}", flush=True)
        raise
    report = run.close()

    t = soak.tally
    wrong = t.count("wrong")
    errors = t.count("error") + t.count("unclean") + t.count("aborted")
    aborted = t.count("aborted", ("abort",))
    lat = t.latencies
    lines.append(
        f"requests={args.requests} concurrency={args.concurrency} transport={args.transport} "
        f"run_s={run_s:.1f} by_kind={t.by_kind}"
    )
    lines.append(
        f"good_correct={t.by_kind.get('good', {}).get('correct', 0)} wrong={wrong} "
        f"errors={errors} aborted={aborted} stalls={len(t.stalls)} "
        f"hostile_correct={t.by_kind.get('hostile', {}).get('correct', 0)}"
    )
    lines.append(
        f"latency p50={percentile(lat, 0.5):.3f}s p95={percentile(lat, 0.95):.3f}s "
        f"max={max(lat, default=float('nan')):.3f}s (client, through the proxy)"
    )
    lines.append(
        "ttft (server histogram bucket bounds) "
        + " ".join(f"{n}: p50<={q[0]} p95<={q[1]}s" for n, q in ttft.items())
    )
    lines.append(f"staging pages in use at end={pages_end:.0f} (polled {pages_s:.1f}s)")
    for name in rss_start:
        bound = rss_start[name] * args.rss_factor + args.rss_slack_mib * MIB
        lines.append(
            f"rss {name}: start={rss_start[name] / MIB:.0f}MiB end={rss_end[name] / MIB:.0f}MiB "
            f"bound={bound / MIB:.0f}MiB"
        )
        if rss_end[name] > bound:
            gates.append(f"{name} RSS grew past its bound")
    lines.append(report.summary())
    if wrong:
        gates.append(f"{wrong} wrong answers")
    if errors:
        gates.append(f"{errors} errors")
    if t.stalls:
        gates.append(f"{len(t.stalls)} requests slower than {args.stall_s}s: {t.stalls[:5]}")
    if not reached:
        gates.append(f"{pages_end:.0f} staging pages still in use")
    if not report.clean:
        gates.append(report.problems())
    for line in lines:
        print(f"[soak] {line}")
    for p in t.first_problems:
        print(f"[soak] problem: {p}")
    verdict = "PASS" if not gates else "FAIL: " + "; ".join(gates)
    print(
        f"[soak] result: {verdict} (wall {time.monotonic() - t_start:.0f}s)",
        flush=True,
    )
    return 0 if not gates else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--transport", choices=["shm", "nixl"], default="shm")
    parser.add_argument("--hostile-frac", type=float, default=0.02)
    parser.add_argument("--abort-frac", type=float, default=0.02)
    parser.add_argument("--lease-s", type=float, default=10.0, help="prefill staging lease")
    parser.add_argument("--stall-s", type=float, default=30.0, help="slower than this: a stall")
    parser.add_argument("--timeout", type=float, default=120.0, help="client timeout per request")
    parser.add_argument("--rss-factor", type=float, default=1.5)
    parser.add_argument("--rss-slack-mib", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def terminate(signum: int, _: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through run.close(): servers stop

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        return run_soak(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
