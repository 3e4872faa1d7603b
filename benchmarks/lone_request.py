"""Where a handed-off request's time goes (issue #71, point 2), one run, every figure from
the same servers:

    .venv/bin/python -m benchmarks.lone_request                 # about 4 minutes
    .venv/bin/python -m benchmarks.lone_request --model scaled  # goodput's 50x model

Servers, each pinned (all its threads): ``aggregated`` (one engine, no KV connector, core 0),
and one P/D pair over shm whose prefill (core 0) hands off to either of two decodes on core
1, the same but for ``sync_loads``: ``sync`` loads in the step that schedules the request
(``sync_loads`` true), ``async`` waits for the worker's report (``sync_loads`` false, the
default). Each decode sits behind this project's proxy and behind vLLM's Rust router
(``vllm-router --vllm-pd-disaggregation``: a generic P/D client, the prefill leg then the
decode leg, as llm-d's sidecar and Dynamo drive it): configurations ``proxy``,
``proxy-async``, ``router``, ``router-async``. The prefill has both decodes as
``decode_peers``, and the proxy names its decode, so every handoff reads the prefill's cache
directly (same host, layout and TP).

1. One at a time (c=1): ``--prompts`` prompts in ``--rounds`` rounds, every configuration
   the same prompts in each round, the order rotated between rounds (drift cancels). Per
   configuration: TTFT, the first-to-second token gap and TPOT (p50, client-side), token-
   exact agreement with the aggregated answers, and the engines' own account from their
   /metrics (means per request): the prefill's time from arrival to its one token (the
   prefill leg inside the engine), the decode's TTFT from its arrival, its queue (the wait
   for its KV included), its first step, and the connector's load.
2. Under load (``--rate``, 0 skips): ``--requests`` at seeded Poisson arrivals to each
   configuration in turn: the gap p50/p95 and TPOT p50/p95.

Then the targets of issue #71 point 2 as ratios measured here: behind the router at c=1,
TTFT at most 1.5x aggregated; a handed-off request's first-to-second token gap at most 2x
the aggregated TPOT. Exit status 1 if any request failed or a P/D answer differed from the
aggregated one at c=1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.goodput import (
    ROUTER,
    Sample,
    Testbed,
    make_requests,
    one_at_a_time,
    open_loop,
    parse_mix,
    pct,
    pin,
    poisson_starts,
)
from testbed.live_servers import (
    LiveRun,
    Server,
    VllmServer,
    kv_config,
    metric_samples,
    wait_all_ready,
)
from testbed.ports import free_port
from testbed.shipped_model import MODEL_DIR

CONFIGS = ("aggregated", "proxy", "router", "proxy-async", "router-async")
# The engines' own account of a request, from their /metrics (histograms: sum and count).
PREFILL_TIMES = {
    "prefill_ttft_ms": "vllm:time_to_first_token_seconds",
    "prefill_e2e_ms": "vllm:e2e_request_latency_seconds",
}
DECODE_TIMES = {
    "decode_ttft_ms": "vllm:time_to_first_token_seconds",
    "decode_queued_ms": "vllm:request_queue_time_seconds",
    "decode_first_step_ms": "vllm:request_prefill_time_seconds",
    "kv_load_ms": "vllm:qaic_kv_load_seconds",
}


def log(msg: str) -> None:
    print(f"[lone_request {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def totals(server: VllmServer, names: dict[str, str]) -> dict[str, tuple[float, float]]:
    import requests

    text = requests.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for key, name in names.items():
        s = sum(v for _, v in metric_samples(text, f"{name}_sum"))
        n = sum(v for _, v in metric_samples(text, f"{name}_count"))
        out[key] = (s, n)
    return out


def means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
          ) -> dict[str, float]:  # fmt: skip
    out = {}
    for key, (s1, n1) in after.items():
        s0, n0 = before[key]
        out[key] = (s1 - s0) / (n1 - n0) * 1e3 if n1 > n0 else math.nan
    return out


def start(run: LiveRun, model: Path, server_args: list[str], front: int
          ) -> tuple[Testbed, dict[str, tuple[VllmServer, VllmServer]]]:  # fmt: skip
    """Every server at once; returns when all answer. Also each P/D configuration's
    (prefill, decode)."""
    args = ["--dtype", "float32", "--no-enable-prefix-caching", *server_args]
    ds_port, da_port = free_port(), free_port()
    peers = [f"127.0.0.1:{ds_port}", f"127.0.0.1:{da_port}"]
    agg = run.vllm("aggregated", "0", None, extra_args=args, model=model)
    p_kv = kv_config("kv_both", run.engine_id("p"), free_port(), "shm", decode_peers=peers)
    prefill = run.vllm("prefill", "0", p_kv, extra_args=args, model=model)
    d_sync = run.vllm("decode", "1",
                      kv_config("kv_both", run.engine_id("ds"), ds_port, "shm", sync_loads=True),
                      extra_args=args, model=model)  # fmt: skip
    d_async = run.vllm("decode-async", "1",
                       kv_config("kv_both", run.engine_id("da"), da_port, "shm",
                                 sync_loads=False), extra_args=args, model=model)  # fmt: skip
    engines = [agg, prefill, d_sync, d_async]
    t0 = time.monotonic()
    wait_all_ready(*engines, retries=1)
    log(f"4 vLLM engines ready in {time.monotonic() - t0:.0f}s")
    cores: dict[str, set[int]] = {"aggregated": {0}, "prefill": {0}, "decode": {1},
                                  "decode-async": {1}}  # fmt: skip
    urls = {"aggregated": agg.url}
    servers: dict[str, list[Server]] = {"aggregated": [agg]}
    pairs = {}
    fronts = []
    for suffix, decode in (("", d_sync), ("-async", d_async)):
        proxy = run.proxy([prefill.url], [decode.url], [decode.side_channel])
        port = free_port()
        router = Server(f"vllm-router{suffix}", [
            str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--prometheus-port", str(free_port()), "--vllm-pd-disaggregation",
            "--prefill", prefill.url, "--decode", decode.url,
        ], {**os.environ, "PYTHONUNBUFFERED": "1"}, run.dir, port)  # fmt: skip
        run.servers.append(router)
        router.start()
        for front_server, config in ((proxy, f"proxy{suffix}"), (router, f"router{suffix}")):
            cores[front_server.name] = {front}
            urls[config] = front_server.url
            servers[config] = [prefill, decode, front_server]
            pairs[config] = (prefill, decode)
            fronts.append(front_server)
    wait_all_ready(*fronts, timeout=120)
    return Testbed(urls, servers, cores), pairs


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("tiny", "scaled"), default="tiny",
                   help="tiny: the shipped 2-layer model (the handoff's overheads dominate);\n"
                   "scaled: goodput's 50x model (compute dominates)")  # fmt: skip
    p.add_argument("--prompts", type=int, default=32, help="c=1 prompts (default 32)")
    p.add_argument("--rounds", type=int, default=4, help="rotations of the order (default 4)")
    p.add_argument(
        "--mix",
        type=parse_mix,
        default=None,
        help="PROMPTxANSWER tokens (default 256x32 tiny, 768x32,192x96 scaled)",
    )
    p.add_argument("--rate", type=float, default=8.0, help="under load, req/s (0: skip)")
    p.add_argument("--requests", type=int, default=32, help="requests under load")
    p.add_argument("--front-core", type=int, choices=(0, 1), default=1)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)  # fmt: skip
    if args.mix is None:
        args.mix = parse_mix("256x32" if args.model == "tiny" else "768x32,192x96")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.monotonic()
    prompts = make_requests(args.prompts, args.mix, "lone")
    rows: dict[str, dict[str, Any]] = {}
    samples: dict[str, list[Sample]] = {c: [] for c in CONFIGS}
    engine: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
    loaded: dict[str, list[Sample]] = {}
    with tempfile.TemporaryDirectory(prefix="qaic-lone-model-") as scratch, \
            LiveRun("lone") as run:  # fmt: skip
        model = MODEL_DIR
        server_args = ["--max-model-len", "1024"]
        if args.model == "scaled":
            from testbed.conversations import scaled_model

            model, server_args = scaled_model(Path(scratch) / "scaled"), ["--max-model-len", "4096"]
        bed, pairs = start(run, model, server_args, args.front_core)
        agg = bed.servers["aggregated"][0]
        assert isinstance(agg, VllmServer)
        pin(bed, args.front_core)
        warm = make_requests(4, args.mix, "warm")
        for config in CONFIGS:
            asyncio.run(one_at_a_time(bed.urls[config], warm))
        pin(bed, args.front_core)
        per_round = math.ceil(len(prompts) / args.rounds)
        for r in range(args.rounds):
            chunk = prompts[r * per_round : (r + 1) * per_round]
            order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
            for config in order:
                # The first engine: the prefill, or the aggregated engine itself.
                p, d = pairs.get(config, (agg, None))
                before = {**totals(p, PREFILL_TIMES), **(totals(d, DECODE_TIMES) if d else {})}
                samples[config] += asyncio.run(one_at_a_time(bed.urls[config], chunk))
                after = {**totals(p, PREFILL_TIMES), **(totals(d, DECODE_TIMES) if d else {})}
                engine[config].append(means(before, after))
            log(f"round {r + 1}/{args.rounds} done [{time.monotonic() - started:.0f}s]")
        if args.rate:
            starts = poisson_starts(args.requests, args.rate)
            reqs = make_requests(args.requests, args.mix, f"rate-{args.rate}")
            for config in CONFIGS:
                loaded[config] = asyncio.run(open_loop(bed.urls[config], reqs, starts))
                log(f"{config} at {args.rate}/s done")
    ref = [s.text for s in samples["aggregated"]]
    errors = 0
    for config in CONFIGS:
        ok = [s for s in samples[config] if not s.error]
        errors += len(samples[config]) - len(ok)
        errors += sum(bool(s.error) for s in loaded.get(config, []))
        row: dict[str, Any] = {
            "ttft_ms": pct([s.ttft for s in ok], 50), "ttft_p95_ms": pct([s.ttft for s in ok], 95),
            "gap12_ms": pct([s.gap12 for s in ok], 50), "tpot_ms": pct([s.tpot for s in ok], 50),
            "agreement": sum(s.text == t for s, t in zip(samples[config], ref, strict=True))
            / len(ref),
        }  # fmt: skip
        for key in (*PREFILL_TIMES, *DECODE_TIMES):
            vals = [m[key] for m in engine[config] if not math.isnan(m.get(key, math.nan))]
            row[key] = sum(vals) / len(vals) if vals else math.nan
        if config in loaded:
            ok_l = [s for s in loaded[config] if not s.error]
            row.update(
                load_gap12_ms=pct([s.gap12 for s in ok_l], 50),
                load_gap12_p95_ms=pct([s.gap12 for s in ok_l], 95),
                load_tpot_ms=pct([s.tpot for s in ok_l], 50),
                load_tpot_p95_ms=pct([s.tpot for s in ok_l], 95),
                load_ttft_ms=pct([s.ttft for s in ok_l], 50),
            )  # fmt: skip
        rows[config] = row
    if args.json:
        meta = {"command": " ".join(["python -m benchmarks.lone_request", *(argv or sys.argv[1:])]),
                "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                "minutes": round((time.monotonic() - started) / 60, 1)}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    report(rows, args)
    bad = errors or any(rows[c]["agreement"] < 1 for c in CONFIGS)
    log(f"done in {(time.monotonic() - started) / 60:.1f} min, {errors} failed requests")
    return 1 if bad else 0


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    def f(v: float, nd: int = 1) -> str:
        return "-" if v is None or math.isnan(v) else f"{v:.{nd}f}"

    print(f"\nc=1, {args.prompts} prompts (mix {args.mix}, model {args.model}); ms, p50 unless "
          "marked; engine columns: means from the engines' /metrics (P: the prefill, or the "
          "aggregated engine; TTFT from its API server's arrival)")  # fmt: skip
    print(f"{'config':<14}{'TTFT':>7}{'p95':>7}{'1st>2nd':>8}{'TPOT':>7}{'agree':>7}{'P TTFT':>8}"
          f"{'P e2e':>8}{'D TTFT':>8}{'D queue':>8}{'D step1':>8}{'D load':>8}")  # fmt: skip
    for c, r in rows.items():
        print(f"{c:<14}{f(r['ttft_ms']):>7}{f(r['ttft_p95_ms']):>7}{f(r['gap12_ms']):>8}"
              f"{f(r['tpot_ms']):>7}{r['agreement']:>7.0%}{f(r['prefill_ttft_ms']):>8}"
              f"{f(r['prefill_e2e_ms']):>8}"
              f"{f(r['decode_ttft_ms']):>8}{f(r['decode_queued_ms']):>8}"
              f"{f(r['decode_first_step_ms']):>8}{f(r['kv_load_ms'], 2):>8}")  # fmt: skip
    if args.rate:
        print(f"\nunder load: {args.requests} requests at {args.rate}/s (Poisson)")
        print(f"{'config':<14}{'TTFT':>7}{'1st>2nd':>8}{'p95':>7}{'TPOT':>7}{'p95':>7}")
        for c, r in rows.items():
            print(f"{c:<14}{f(r['load_ttft_ms']):>7}{f(r['load_gap12_ms']):>8}"
                  f"{f(r['load_gap12_p95_ms']):>7}{f(r['load_tpot_ms']):>7}"
                  f"{f(r['load_tpot_p95_ms']):>7}")  # fmt: skip
    agg = rows["aggregated"]
    print("\nissue #71 point 2, ratios to aggregated in this run:")
    for c in CONFIGS[1:]:
        r = rows[c]
        line = (
            f"  {c:<13} TTFT {r['ttft_ms'] / agg['ttft_ms']:.2f}x (<= 1.5x for the router); "
            f"1st>2nd / aggregated TPOT {r['gap12_ms'] / agg['tpot_ms']:.2f}x (<= 2x)"
        )
        if args.rate:
            line += f", under load {r['load_gap12_ms'] / agg['load_tpot_ms']:.2f}x"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
