"""Goodput at latency targets on the same two cores (issue #71, point 1): split them into a
prefill and a decode, or run them aggregated?

    make goodput                                        # about 20 minutes
    .venv/bin/python -m benchmarks.goodput --quick      # about 3 minutes
    .venv/bin/python -m benchmarks.goodput --rates 0.2 0.4 --requests 16 --json g.json

Four configurations of the same two cores, every server pinned (all its threads):

- ``pd-proxy``: 1P1D over shm behind this project's proxy, the prefill on core 0, the decode
  on core 1 (the proxy names the decode, ``--decode-kv``).
- ``pd-vllm-router``: the same two engines behind vLLM's Rust router
  (``vllm-router --vllm-pd-disaggregation --policy round_robin``); it names no decode, so the
  prefill has ``decode_peers`` in its extra config. Both P/D configurations share one pair of
  engines (prefix caching is off everywhere, so no request finds another's KV).
- ``2-replicas``: two aggregated engines (no KV connector), one per core, behind vllm-router
  in its plain mode (``--worker-urls A B --policy round_robin``): the same router binary, no
  disaggregation.
- ``1-engine``: one aggregated engine on both cores (``VLLM_CPU_OMP_THREADS_BIND=0-1``).

The proxy, the routers and this client run on core 1 (``--front-core``) in every
configuration. The model is ``testbed.conversations.scaled_model``: random weights, 50x the
shipped model's compute (hidden 512, 8 layers), the shipped word-level tokenizer, served in
float32, so a long prompt's prefill takes long enough to stall the decodes batched with it.
Every request is greedy, streamed, ``ignore_eos`` with a fixed ``max_tokens`` and the special
tokens banned (``logit_bias``): every streamed chunk is one word, one token, so answers compare
token for token by their text.

Every server starts at once (one start-up) and stays up; each configuration is measured in
turn while the others idle (their CPU seconds during each measurement are printed).

1. Low load: ``--low-load`` prompts one at a time through every configuration. The
   1-engine's answers are the reference: agreement is token-exact against them. The targets
   come from the best unloaded aggregated figures here (the 1-engine's or one replica's,
   whichever is lower): TTFT <= 4x the TTFT p95 (the long prompts' unloaded TTFT, with room
   for a queue of a few prefills), TPOT <= 2.5x the TPOT p50 (a decode may batch and may
   share its steps with some prefill work, not stall for whole long prompts); a strict TPOT
   target of 1.5x gives a second goodput column (``--ttft-factor``, ``--tpot-factor``,
   ``--strict-tpot-factor``, or absolute ``--ttft-ms``/``--tpot-ms``).
2. The sweep: per arrival rate, ``--requests`` prompts at seeded Poisson arrival times (open
   loop: sent whatever is in flight), the same prompts and times for every configuration, the
   order of configurations flipped from one rate to the next.

Per configuration and rate it prints goodput (requests meeting both targets per second, from
the first request sent to the last answer's end; the same at the strict TPOT target), the
share that met them, the rate the arrivals really had, TTFT/TPOT/ITL
p50/p95, the gap between the first and second token (p50/p95), errors, and agreement with the
1-engine's answers at the same rate. Then, per configuration, the highest rate at which 90% of
requests met both targets. ``--json`` and ``--plot`` (goodput against rate, one line per
configuration). Exit status 1 if a P/D configuration answered a low-load prompt other than
the two replicas (the same one-core engines without a handoff) did, or any request failed.
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
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks.compare_e2e import cpu_seconds
from testbed.live_servers import LiveRun, Server, VllmServer, kv_config, wait_all_ready
from testbed.ports import free_port
from testbed.shipped_model import MODEL_DIR, PY, ROOT

CONFIGS = ("pd-proxy", "pd-vllm-router", "2-replicas", "1-engine")
REFERENCE = "1-engine"
ROUTER = Path(PY).parent / "vllm-router"
# pad, bos, eos, unk of the shipped tokenizer: never generated, so each chunk is one word
BANNED = {str(i): -100 for i in range(4)}
ATTAINMENT = 0.9  # DistServe's: the highest rate at which 90% of requests meet both targets


def log(msg: str) -> None:
    print(f"[goodput {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- the workload ----------------------------------------------------------------------------


def parse_mix(text: str) -> list[tuple[int, int]]:
    """``"1024x64,256x256"``: (prompt tokens, answer tokens) classes, drawn uniformly."""
    out = []
    for part in text.split(","):
        p, a = part.lower().split("x")
        out.append((int(p), int(a)))
    return out


def words() -> list[str]:
    vocab = json.loads((MODEL_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    return [w for w, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= 4]


def make_requests(n: int, mix: list[tuple[int, int]], seed: str) -> list[tuple[str, int]]:
    """``n`` (prompt, max_tokens) pairs: a prompt of P random words is P tokens (word-level
    tokenizer, no special token added), after ``<bos>``. Classes cycle in a shuffled order so
    that every set holds each class about equally."""
    rng, vocab = random.Random(f"goodput-{seed}"), words()
    classes = [mix[i % len(mix)] for i in range(n)]
    rng.shuffle(classes)
    return [("<bos> " + " ".join(rng.choices(vocab, k=p - 1)), a) for p, a in classes]


# --- one streamed request --------------------------------------------------------------------


@dataclass
class Sample:
    """One streamed answer. vLLM merges the tokens of a stream whose client has not yet read
    the last ones into one chunk, so a chunk may hold several tokens: each token is a word
    here, and each gets its chunk's arrival time (``tokens``)."""

    sent: float  # monotonic seconds
    times: list[float] = field(default_factory=list)  # each chunk with text, monotonic
    tokens: list[float] = field(default_factory=list)  # each token's chunk's time
    text: str = ""
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.sent if self.tokens else math.nan

    @property
    def gap12(self) -> float:
        return self.tokens[1] - self.tokens[0] if len(self.tokens) > 1 else math.nan

    @property
    def tpot(self) -> float:
        n = len(self.tokens)
        return (self.tokens[-1] - self.tokens[0]) / (n - 1) if n > 1 else math.nan

    @property
    def itls(self) -> list[float]:
        """Between chunks, as `vllm bench serve` counts them."""
        return [b - a for a, b in itertools.pairwise(self.times)]

    @property
    def end(self) -> float:
        return self.times[-1] if self.times else self.sent


async def stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "logit_bias": BANNED, "stream": True,
    }  # fmt: skip
    s = Sample(time.monotonic())
    parts: list[str] = []
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                s.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return s
            async for raw in r.content:
                line = raw.strip()
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if event.get("error"):
                        s.error = str(event["error"])[:300]
                    for choice in event.get("choices") or ():
                        if choice.get("text"):
                            s.times.append(time.monotonic())
                            parts.append(choice["text"])
                            s.tokens += [s.times[-1]] * len(choice["text"].split())
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.text = "".join(parts)
    if not s.error and len(s.tokens) != max_tokens:
        s.error = f"{len(s.tokens)} tokens streamed, {max_tokens} asked"
    return s


async def open_loop(url: str, reqs: list[tuple[str, int]], starts: list[float]) -> list[Sample]:
    """Each request sent at its time from now (``starts``), whatever is in flight."""
    timeout = aiohttp.ClientTimeout(total=900)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        t0 = time.monotonic()

        async def one(req: tuple[str, int], at: float) -> Sample:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            return await stream(session, url, *req)

        return await asyncio.gather(*(one(r, t) for r, t in zip(reqs, starts, strict=True)))


async def one_at_a_time(url: str, reqs: list[tuple[str, int]]) -> list[Sample]:
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return [await stream(session, url, *r) for r in reqs]


def poisson_starts(n: int, rate: float) -> list[float]:
    """Send times of ``n`` Poisson arrivals at ``rate``, the first at once: one seeded draw of
    exponential gaps, rescaled so that their mean is exactly 1 / ``rate``. Every rate gets the
    same shape, so a few dozen requests cannot make a higher rate arrive slower than a lower
    one."""
    rng = random.Random("goodput-arrivals")
    gaps = [rng.expovariate(1.0) for _ in range(n - 1)]
    scale = (n - 1) / rate / sum(gaps) if gaps else 0.0
    return [0.0, *itertools.accumulate(g * scale for g in gaps)]


# --- statistics ------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ok = [v for v in values if not math.isnan(v)]
    return float(np.percentile(ok, q)) * 1e3 if ok else math.nan  # ms


@dataclass
class Row:
    config: str
    rate: float  # offered requests/s (0: low load, one at a time)
    requests: int
    errors: int
    sent_per_s: float  # the rate the seeded arrivals really had (first to last send)
    goodput: float  # requests meeting both targets per second
    attainment: float  # share of requests meeting both
    goodput_strict: float  # the same at the strict TPOT target
    throughput: float  # answered requests per second
    ttft_p50_ms: float
    ttft_p95_ms: float
    tpot_p50_ms: float
    tpot_p95_ms: float
    itl_p50_ms: float
    itl_p95_ms: float
    gap12_p50_ms: float  # the first token to the second
    gap12_p95_ms: float
    agreement: float  # token-exact against the 1-engine's answers to the same prompts
    others_cpu_s: float = math.nan  # CPU seconds of the idle configurations' servers meanwhile
    foreign_cpu_s: float = math.nan  # CPU seconds of processes of neither, on this host


def summarize(config: str, rate: float, samples: list[Sample], ref: list[str] | None,
              targets: dict[str, float], others_cpu: float) -> Row:  # fmt: skip
    """``targets``: ttft_ms, tpot_ms, strict_tpot_ms (empty: none yet, every request meets)."""
    ok = [s for s in samples if not s.error]
    ttft_s = targets.get("ttft_ms", math.inf) / 1e3
    met = [s for s in ok if s.ttft <= ttft_s and s.tpot <= targets.get("tpot_ms", math.inf) / 1e3]
    strict = [s for s in met if s.tpot <= targets.get("strict_tpot_ms", math.inf) / 1e3]
    sends = sorted(s.sent for s in samples)
    span = max(s.end for s in samples) - sends[0]
    sent = (len(sends) - 1) / (sends[-1] - sends[0]) if rate and len(sends) > 1 else math.nan
    same = sum(s.text == r for s, r in zip(samples, ref or [], strict=False))
    return Row(
        config, rate, len(samples), len(samples) - len(ok), round(sent, 3),
        round(len(met) / span, 4), round(len(met) / len(samples), 3),
        round(len(strict) / span, 4), round(len(ok) / span, 4),
        round(pct([s.ttft for s in ok], 50), 1), round(pct([s.ttft for s in ok], 95), 1),
        round(pct([s.tpot for s in ok], 50), 2), round(pct([s.tpot for s in ok], 95), 2),
        round(pct([x for s in ok for x in s.itls], 50), 2),
        round(pct([x for s in ok for x in s.itls], 95), 2),
        round(pct([s.gap12 for s in ok], 50), 1), round(pct([s.gap12 for s in ok], 95), 1),
        round(same / len(samples), 3) if ref else math.nan,
        round(others_cpu, 1),
    )  # fmt: skip


# --- servers ---------------------------------------------------------------------------------


@dataclass
class Testbed:
    urls: dict[str, str]  # configuration -> the URL its clients ask
    servers: dict[str, list[Server]]  # configuration -> its servers (shared ones in both)
    cores: dict[str, set[int]]  # a server's name -> its cores


def start_all(run: LiveRun, model: Path, configs: list[str], server_args: list[str],
              front: int) -> Testbed:  # fmt: skip
    """Every configuration's servers at once; returns when all answer /health."""
    args = ["--max-model-len", "4096", "--dtype", "float32", "--no-enable-prefix-caching",
            *server_args]  # fmt: skip
    urls: dict[str, str] = {}
    servers: dict[str, list[Server]] = {}
    cores: dict[str, set[int]] = {}
    engines: list[VllmServer] = []

    def vllm(name: str, core: str, kv: dict[str, Any] | None) -> VllmServer:
        s = run.vllm(name, core, kv, extra_args=args, model=model)
        engines.append(s)
        cores[name] = {0, 1} if "-" in core else {int(core)}
        return s

    pd = [c for c in configs if c.startswith("pd-")]
    if pd:
        d_port = free_port()
        d_kv = kv_config("kv_both", run.engine_id("d"), d_port, "shm")
        p_kv = kv_config("kv_both", run.engine_id("p"), free_port(), "shm",
                         decode_peers=[f"127.0.0.1:{d_port}"])  # fmt: skip
        prefill, decode = vllm("prefill", "0", p_kv), vllm("decode", "1", d_kv)
    if "2-replicas" in configs:
        replicas = [vllm("replica0", "0", None), vllm("replica1", "1", None)]
    if "1-engine" in configs:
        single = vllm("one-engine", "0-1", None)
        urls["1-engine"], servers["1-engine"] = single.url, [single]
    t0 = time.monotonic()
    wait_all_ready(*engines, retries=1)
    log(f"{len(engines)} vLLM engines ready in {time.monotonic() - t0:.0f}s")

    def front_server(name: str, argv: list[str], port: int) -> Server:
        s = Server(name, argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, run.dir, port)
        run.servers.append(s)
        s.start()
        cores[name] = {front}
        return s

    def router(name: str, *argv: str) -> Server:
        port = free_port()
        return front_server(name, [str(ROUTER), "--host", "127.0.0.1", "--port", str(port),
                                   "--policy", "round_robin", "--prometheus-port",
                                   str(free_port()), *argv], port)  # fmt: skip

    fronts = []
    if "pd-proxy" in configs:
        proxy = run.proxy([prefill.url], [decode.url], [decode.side_channel])
        cores[proxy.name] = {front}
        fronts.append(proxy)
        urls["pd-proxy"], servers["pd-proxy"] = proxy.url, [prefill, decode, proxy]
    if "pd-vllm-router" in configs:
        pd_router = router("vllm-router-pd", "--vllm-pd-disaggregation", "--prefill",
                           prefill.url, "--decode", decode.url)  # fmt: skip
        fronts.append(pd_router)
        urls["pd-vllm-router"] = pd_router.url
        servers["pd-vllm-router"] = [prefill, decode, pd_router]
    if "2-replicas" in configs:
        rr = router("vllm-router-rr", "--worker-urls", *(r.url for r in replicas))
        fronts.append(rr)
        urls["2-replicas"], servers["2-replicas"] = rr.url, [*replicas, rr]
    wait_all_ready(*fronts, timeout=120)
    return Testbed(urls, servers, cores)


def pin(bed: Testbed, front: int) -> None:
    """Every thread of every server on its cores (vLLM binds only its OpenMP threads: its API
    server and engine core would float), this client on ``front``. Again after warming up:
    threads started later inherit their creator's mask, but not always the right one."""
    if not {0, 1} <= os.sched_getaffinity(0):
        return  # not the two-core host this is laid out for
    os.sched_setaffinity(0, {front})
    seen: set[str] = set()
    for s in (s for group in bed.servers.values() for s in group):
        if s.name in seen:
            continue
        seen.add(s.name)
        mask = bed.cores[s.name]
        for pid in s.pids():
            with contextlib.suppress(OSError):
                for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                    with contextlib.suppress(OSError):
                        # vLLM's OpenMP threads are bound one per core: keep that
                        if not os.sched_getaffinity(tid) <= mask:
                            os.sched_setaffinity(tid, mask)


def busy_seconds() -> float:
    """CPU seconds every core of this host spent busy since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def others_cpu(bed: Testbed, config: str) -> list[Server]:
    mine = {id(s) for s in bed.servers[config]}
    out: dict[int, Server] = {}
    for group in bed.servers.values():
        for s in group:
            if id(s) not in mine:
                out[id(s)] = s
    return list(out.values())


# --- the run ---------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[0.5, 1.0, 1.5, 2.0, 3.0, 4.0],
        help="offered requests/s, Poisson (default 0.5 1 1.5 2 3 4)",
    )
    p.add_argument("--requests", type=int, default=32, help="requests per rate (default 32)")
    p.add_argument(
        "--mix",
        type=parse_mix,
        default=parse_mix("1536x64,384x192"),
        help="PROMPTxANSWER token classes, drawn uniformly (default\n"
        "1536x64,384x192: long prompts with short answers, short prompts with\n"
        "long answers; half of the requests each)",
    )
    p.add_argument(
        "--low-load",
        type=int,
        default=6,
        help="prompts sent one at a time to every configuration (default 6)",
    )
    p.add_argument(
        "--ttft-factor",
        type=float,
        default=4.0,
        help="TTFT target: this x the lowest aggregated low-load TTFT p95 (the 1-engine's\n"
        "or the replicas'; default 4)",
    )
    p.add_argument(
        "--tpot-factor",
        type=float,
        default=2.5,
        help="TPOT target: this x the lowest aggregated low-load TPOT p50 (default 2.5)",
    )
    p.add_argument(
        "--strict-tpot-factor",
        type=float,
        default=1.5,
        help="a second, strict TPOT target for the goodput_strict column (default 1.5)",
    )
    p.add_argument("--ttft-ms", type=float, help="an absolute TTFT target instead")
    p.add_argument("--tpot-ms", type=float, help="an absolute TPOT target instead")
    p.add_argument(
        "--front-core",
        type=int,
        choices=(0, 1),
        default=1,
        help="the core of the proxy, the routers and this client (default 1)",
    )
    p.add_argument(
        "--server-args",
        type=shlex.split,
        default=[],
        help='more vllm serve arguments for every engine, e.g. "--max-num-seqs 8"',
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=0.5,
        help="each engine's KV cache (default 0.5 GiB: 64k tokens of this model)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="about 3 minutes: rates 1.5 4, 10 requests each, mix 768x32,192x96,\n"
        "2 low-load prompts",
    )
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    args = p.parse_args(argv)  # fmt: skip
    if args.quick:
        args.rates, args.requests, args.low_load = [1.5, 4.0], 10, 2
        args.mix = parse_mix("768x32,192x96")
    if REFERENCE not in args.configs:
        args.configs.append(REFERENCE)  # the reference answers and the targets
    return args


def host_kind() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["bash", str(ROOT / "scripts" / "host_isa.sh")],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        return out.stdout.strip()
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from testbed.conversations import scaled_model

    started = time.monotonic()
    order = [c for c in CONFIGS if c in args.configs]
    kv_bytes = int(args.kv_cache_gib * (1 << 30))
    server_args = ["--kv-cache-memory-bytes", str(kv_bytes), *args.server_args]
    low = make_requests(args.low_load, args.mix, "low")
    warm = make_requests(2 * len(args.mix), args.mix, "warm")
    rows: list[Row] = []
    unloaded: dict[str, list[Sample]] = {}
    targets: dict[str, float] = {}
    raw: list[dict[str, Any]] = []  # every request of the sweep
    with tempfile.TemporaryDirectory(prefix="qaic-goodput-model-") as scratch, \
            LiveRun("goodput") as run:  # fmt: skip
        model = scaled_model(Path(scratch) / "scaled")
        log(f"starting {', '.join(order)} (mix {args.mix}, model {model.name})")
        bed = start_all(run, model, order, server_args, args.front_core)
        pin(bed, args.front_core)
        for config in order:  # a first batch of a new shape is slow on vLLM's CPU backend
            t0 = time.monotonic()
            asyncio.run(open_loop(bed.urls[config], warm, [0.0] * len(warm)))
            log(f"{config}: warmed in {time.monotonic() - t0:.0f}s")
        pin(bed, args.front_core)
        # 1. low load: reference answers, targets, each configuration's unloaded times
        low_order = [REFERENCE, *(c for c in order if c != REFERENCE)]
        for config in low_order:
            unloaded[config] = asyncio.run(one_at_a_time(bed.urls[config], low))
            for s in unloaded[config]:
                if s.error:
                    log(f"{config} low load: {s.error}")
            ref = [s.text for s in unloaded[REFERENCE]]
            row = summarize(config, 0.0, unloaded[config], ref, {}, math.nan)
            rows.append(row)
            log(f"{config} low load: TTFT p50 {row.ttft_p50_ms:.0f} ms p95 "
                f"{row.ttft_p95_ms:.0f} ms, TPOT p50 {row.tpot_p50_ms:.1f} ms, 1st->2nd "
                f"{row.gap12_p50_ms:.0f} ms, agreement {row.agreement:.0%}")  # fmt: skip
        # The best unloaded aggregated figures on these cores: the 1-engine's or one
        # replica's (a lone request on one core), whichever is lower.
        agg = [r for r in rows if r.config in (REFERENCE, "2-replicas")]
        base_ttft = min((r.ttft_p95_ms for r in agg if r.ttft_p95_ms > 0), default=math.nan)
        base_tpot = min((r.tpot_p50_ms for r in agg if r.tpot_p50_ms > 0), default=math.nan)
        targets["ttft_ms"] = args.ttft_ms or round(args.ttft_factor * base_ttft, 1)
        targets["tpot_ms"] = args.tpot_ms or round(args.tpot_factor * base_tpot, 2)
        targets["strict_tpot_ms"] = round(args.strict_tpot_factor * base_tpot, 2)
        log(f"targets: TTFT <= {targets['ttft_ms']:.0f} ms, TPOT <= {targets['tpot_ms']:.1f} ms "
            f"(strict: TPOT <= {targets['strict_tpot_ms']:.1f} ms)")  # fmt: skip
        for i, config in enumerate(low_order):
            rows[i] = summarize(config, 0.0, unloaded[config], ref, targets, math.nan)
        # 2. the sweep
        for k, rate in enumerate(args.rates):
            reqs = make_requests(args.requests, args.mix, f"rate-{rate}")
            starts = poisson_starts(args.requests, rate)
            answers: dict[str, list[str]] = {}
            at_rate: list[Row] = []
            for config in order if k % 2 == 0 else order[::-1]:
                idle, mine = others_cpu(bed, config), bed.servers[config]
                cpu0, mine0 = cpu_seconds(idle), cpu_seconds(mine)
                busy0, own0 = busy_seconds(), own_seconds()
                samples = asyncio.run(open_loop(bed.urls[config], reqs, starts))
                idle_cpu = cpu_seconds(idle) - cpu0
                foreign = busy_seconds() - busy0 - (own_seconds() - own0) - idle_cpu - (
                    cpu_seconds(mine) - mine0)  # fmt: skip
                answers[config] = [s.text for s in samples]
                for s in samples:
                    if s.error:
                        log(f"{config} at {rate}/s: {s.error}")
                at_rate.append(summarize(config, rate, samples, None, targets, idle_cpu))
                at_rate[-1].foreign_cpu_s = round(foreign, 1)
                first = min(s.sent for s in samples)
                raw.extend(dict(config=config, rate=rate, sent_s=s.sent - first,
                                end_s=s.end - first, ttft_ms=s.ttft * 1e3,
                                tpot_ms=s.tpot * 1e3, gap12_ms=s.gap12 * 1e3,
                                tokens=len(s.tokens), chunks=len(s.times), error=s.error)
                           for s in samples)  # fmt: skip
                r = at_rate[-1]
                log(f"{config} at {rate}/s: goodput {r.goodput:.3f}/s ({r.attainment:.0%} "
                    f"met), TTFT p50/p95 {r.ttft_p50_ms:.0f}/{r.ttft_p95_ms:.0f} ms, TPOT "
                    f"{r.tpot_p50_ms:.0f}/{r.tpot_p95_ms:.0f} ms, errors {r.errors}, CPU-s of "
                    f"idle configs {idle_cpu:.1f}, of other processes {foreign:.1f} "
                    f"[{time.monotonic() - started:.0f}s]")  # fmt: skip
            for r in at_rate:  # agreement with the 1-engine's answers at the same rate
                ref_at = answers[REFERENCE]
                same = sum(a == b for a, b in zip(answers[r.config], ref_at, strict=True))
                r.agreement = round(same / len(ref_at), 3)
            rows.extend(sorted(at_rate, key=lambda r: order.index(r.config)))
    if run.report is not None and not run.report.clean:
        log(f"left things behind: {run.report.problems()}")
    report(rows, targets, order, args)
    meta = {
        "command": shlex.join(["python", "-m", "benchmarks.goodput", *(argv or sys.argv[1:])]),
        "host": host_kind(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "mix": args.mix, "rates": args.rates, "requests_per_rate": args.requests,
        "targets": targets, "minutes": round((time.monotonic() - started) / 60, 1),
        "configs": order,
    }  # fmt: skip
    for path in (args.json, args.plot):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.json:
        out = {"meta": meta, "rows": [asdict(r) for r in rows], "requests": raw}
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(rows, order, targets, args.plot)
    log(f"done in {meta['minutes']} min")
    low_rows = {r.config: r for r in rows if r.rate == 0}
    floor = low_rows["2-replicas"].agreement if "2-replicas" in low_rows else 1.0
    bad = any(r.errors for r in rows if r.config.startswith("pd-")) or any(
        r.agreement < floor for c, r in low_rows.items() if c.startswith("pd-"))  # fmt: skip
    return 1 if bad else 0


def report(rows: list[Row], targets: dict[str, float], order: list[str],
           args: argparse.Namespace) -> None:  # fmt: skip
    print(f"\nmix {args.mix} (prompt x answer tokens), {args.requests} requests a rate; targets "
          f"TTFT <= {targets['ttft_ms']:.0f} ms and TPOT <= {targets['tpot_ms']:.1f} ms "
          f"(strict: TPOT <= {targets['strict_tpot_ms']:.1f} ms); goodput: requests meeting "
          "both per second, first send to last answer; met: their share; agreement: low "
          "load against the 1-engine's answers, under load against its answers at the same "
          "rate")  # fmt: skip
    head = (f"{'config':<15}{'rate':>6}{'sent/s':>7}{'goodput':>9}{'met':>6}{'strict':>8}"
            f"{'tput':>7}{'TTFT p50':>10}"
            f"{'p95':>8}{'TPOT p50':>10}{'p95':>7}{'ITL p50':>9}{'p95':>7}{'1st>2nd':>9}"
            f"{'p95':>7}{'agree':>7}{'err':>5}")  # fmt: skip
    print(head)
    for r in rows:
        rate = "low" if r.rate == 0 else f"{r.rate:g}"
        if r.rate == 0:  # one at a time: no rate, so no goodput
            rates = f"{'-':>7}{'-':>9}{r.attainment:>6.0%}{'-':>8}{'-':>7}"
        else:
            rates = (f"{r.sent_per_s:>7.2f}{r.goodput:>9.3f}{r.attainment:>6.0%}"
                     f"{r.goodput_strict:>8.3f}{r.throughput:>7.3f}")  # fmt: skip
        print(f"{r.config:<15}{rate:>6}{rates}"
              f"{r.ttft_p50_ms:>10.0f}{r.ttft_p95_ms:>8.0f}{r.tpot_p50_ms:>10.1f}"
              f"{r.tpot_p95_ms:>7.1f}{r.itl_p50_ms:>9.1f}{r.itl_p95_ms:>7.1f}"
              f"{r.gap12_p50_ms:>9.0f}{r.gap12_p95_ms:>7.0f}{r.agreement:>7.0%}"
              f"{r.errors:>5}")  # fmt: skip
    print(f"\nthe highest swept rate at which >= {ATTAINMENT:.0%} met both targets; the best "
          "goodput measured")  # fmt: skip
    for c in order:
        mine = [r for r in rows if r.config == c and r.rate > 0]
        ok = [r.rate for r in mine if r.attainment >= ATTAINMENT]
        best = max(mine, key=lambda r: r.goodput, default=None)
        print(f"  {c:<15} {max(ok) if ok else 0:g} req/s; best goodput "
              f"{best.goodput if best else 0:.3f}/s at {best.rate if best else 0:g}/s")  # fmt: skip
    idle = [r.others_cpu_s for r in rows if r.rate > 0 and not math.isnan(r.others_cpu_s)]
    if idle:
        print(f"the idle configurations' servers used {min(idle):.1f}-{max(idle):.1f} CPU-s "
              "during each measurement")  # fmt: skip
    foreign = [r.foreign_cpu_s for r in rows if r.rate > 0 and not math.isnan(r.foreign_cpu_s)]
    if foreign:
        print(f"processes of no configuration (other work on this host) used "
              f"{min(foreign):.1f}-{max(foreign):.1f} CPU-s during each measurement")  # fmt: skip


def plot(rows: list[Row], order: list[str], targets: dict[str, float], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for c in order:
        mine = sorted((r for r in rows if r.config == c and r.rate > 0), key=lambda r: r.rate)
        xs = [r.rate for r in mine]
        axes[0].plot(xs, [r.goodput for r in mine], marker="o", label=c)
        axes[1].plot(xs, [r.ttft_p95_ms for r in mine], marker="o", label=c)
        axes[2].plot(xs, [r.tpot_p95_ms for r in mine], marker="o", label=c)
    axes[0].plot(axes[0].get_xlim(), axes[0].get_xlim(), color="grey", lw=0.5, ls=":")
    axes[0].set(xlabel="offered rate (req/s)", ylabel="goodput (req/s)",
                title=f"goodput: TTFT <= {targets['ttft_ms']:.0f} ms and "
                f"TPOT <= {targets['tpot_ms']:.0f} ms")  # fmt: skip
    axes[1].axhline(targets["ttft_ms"], color="grey", ls="--", lw=0.8)
    axes[1].set(xlabel="offered rate (req/s)", ylabel="ms", title="TTFT p95", yscale="log")
    axes[2].axhline(targets["tpot_ms"], color="grey", ls="--", lw=0.8)
    axes[2].set(xlabel="offered rate (req/s)", ylabel="ms", title="TPOT p95")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    sys.exit(main())
