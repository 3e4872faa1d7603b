"""Accuracy harness client: sends prompts to an OpenAI-compatible server and judges runs.

run      send NUM prompts, CONCURRENCY at a time, save completions as JSON
verdict  compare a disaggregated run with an aggregated one, plus the decode's metrics
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from pathlib import Path

import aiohttp
import requests

from testbed import copy_task
from testbed.copy_task import token_agreement
from testbed.llm_d_sidecar import sidecar_completion


def build_prompts(
    task: str, n: int, model_dir: str | None = None, kept: str | None = None
) -> list[tuple[str, str | None]]:
    """``n`` prompts and their expected answers (None: any). ``kept``: a file that holds the
    text prompts a run drew before (the same seed: a longer list starts with a shorter one),
    so that a harness run loads the model's tokenizer (4-5 s here) once, not per step."""
    if task == "copy":
        return [(p, a) for p, a in copy_task.heldout_prompts(n)]
    if kept and Path(kept).exists() and len(drawn := json.loads(Path(kept).read_text())) >= n:
        return [(text, None) for text in drawn[:n]]
    # Any other model: text decoded from random non-special token ids of its own tokenizer,
    # so every prompt is made of tokens the model knows, whatever the tokenizer.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(1234)
    texts = [tok.decode([rng.choice(ids) for _ in range(rng.randint(60, 300))]) for _ in range(n)]
    if kept:
        Path(kept).write_text(json.dumps(texts))
    return [(text, None) for text in texts]


def decode_loads(urls: list[str]) -> tuple[float, float]:
    """(loaded requests, load failures) summed over the decodes' connector metrics."""
    texts = [requests.get(u + "/metrics", timeout=10).text for u in urls]
    return tuple(  # type: ignore[return-value]
        sum(metric(t, f"vllm:qaic_kv_{name}_total") for t in texts)
        for name in ("loaded_requests", "load_failures")
    )


def loaded_since(urls: list[str], before: tuple[float, float], wait_s: float = 5.0) -> bool:
    """Whether the decodes loaded one more request (and failed none) since ``before``: the
    connector's counters reach /metrics a step or two after the answer."""
    deadline = time.monotonic() + wait_s
    while True:
        loaded, failed = decode_loads(urls)
        if failed > before[1]:
            return False
        if loaded > before[0] or time.monotonic() > deadline:
            return loaded > before[0]
        time.sleep(0.2)


async def run(args: argparse.Namespace) -> None:
    gaps = args.gaps or []
    count = len(gaps) if gaps else args.num_prompts
    drawn = build_prompts(args.task, args.offset + count, args.model_dir, args.prompts_file)
    prompts = drawn[args.offset :]
    max_tokens = copy_task.answer_max_tokens() if args.task == "copy" else 16
    # One at a time after each gap (the first right away), or CONCURRENCY at a time.
    sem = asyncio.Semaphore(1 if gaps else args.concurrency)
    results: list[dict | None] = [None] * len(prompts)
    done = 0

    async def one(i: int, session: aiohttp.ClientSession) -> None:
        nonlocal done
        body = {
            "model": args.model,
            "prompt": prompts[i][0],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": 0,
            "return_token_ids": True,  # the verdict compares tokens, not only their text
        }
        if args.cache_salt:
            body["cache_salt"] = args.cache_salt
        async with sem:
            if gaps:
                await asyncio.sleep(gaps[i])
                before = await asyncio.to_thread(decode_loads, args.decode_urls)
            t0, prefill_s = time.monotonic(), 0.0
            if args.sidecar:  # llm-d's sidecar: the decode's URL, the prefill leg first
                rid, urls = f"{args.label}-{i}-{time.monotonic_ns()}", (args.sidecar, args.url)
                status, payload = await sidecar_completion(session, *urls, body, rid)
            else:
                async with session.post(args.url + "/v1/completions", json=body) as resp:
                    status, payload = resp.status, await resp.json(content_type=None)
                # The proxy's Server-Timing: the prefill leg's share (its queue and forward).
                timing = re.search(r"prefill;dur=([0-9.]+)", resp.headers.get("Server-Timing", ""))
                prefill_s = float(timing.group(1)) / 1e3 if timing else 0.0
            seconds = time.monotonic() - t0
            if status != 200:
                results[i] = {"error": f"HTTP {status}: {str(payload)[:300]}"}
            else:
                choice = payload["choices"][0]
                results[i] = {
                    "text": choice["text"],
                    "token_ids": choice.get("token_ids"),
                    "prompt_tokens": payload["usage"]["prompt_tokens"],
                    "seconds": seconds,
                    "prefill_seconds": prefill_s,
                }
                if gaps:
                    loaded = await asyncio.to_thread(loaded_since, args.decode_urls, before)
                    results[i]["loaded"] = loaded  # type: ignore[index]
                    how = "from loaded KV" if loaded else "NOT from loaded KV"
                    print(
                        f"  [{args.label}] after {gaps[i]:g}s idle: {seconds:.2f}s "
                        f"(prefill leg {prefill_s:.2f}s), {how}"
                    )
        done += 1
        if done % max(1, len(prompts) // 8) == 0 or done == len(prompts):
            print(f"  [{args.label}] {done}/{len(prompts)} done", flush=True)

    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if gaps:  # in order: each gap is idle time before its request
            for i in range(len(prompts)):
                await one(i, session)
        else:
            await asyncio.gather(*(one(i, session) for i in range(len(prompts))))
    out = [
        {"prompt": p, "answer": a, **(r or {})} for (p, a), r in zip(prompts, results, strict=False)
    ]
    Path(args.out).write_text(json.dumps(out))


def samples(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every Prometheus sample of ``name``."""
    pattern = rf"^{re.escape(name)}(?:\{{([^}}]*)\}})?\s+([0-9.eE+-]+)$"
    return [
        (m.group(1) or "", float(m.group(2)))
        for line in text.splitlines()
        if (m := re.match(pattern, line))
    ]


def metric(text: str, name: str) -> float:
    return sum(value for _, value in samples(text, name))


def loads_by_peer(text: str) -> dict[str, float]:
    """Loaded requests per ``remote_engine`` label (the prefill the KV came from)."""
    peers: dict[str, float] = {}
    for labels, value in samples(text, "vllm:qaic_kv_loaded_requests_by_peer_total"):
        peer = re.search(r'remote_engine="([^"]*)"', labels)
        if peer:
            peers[peer.group(1)] = peers.get(peer.group(1), 0.0) + value
    return peers


def accuracy(rows: list[dict]) -> float:
    ok = sum(
        1
        for r in rows
        if "text" in r and r["answer"] is not None and copy_task.is_correct(r["text"], r["answer"])
    )
    return ok / len(rows)


def same_answer(d: dict, a: dict) -> bool:
    """The same token ids (every server here returns them) and the same text."""
    ids = d.get("token_ids")
    return ids is not None and ids == a.get("token_ids") and d.get("text") == a.get("text")


def lone_failures(lone: list[dict], agg: list[dict], first_max_s: float = 10.0) -> list[str]:
    """Requests sent one at a time after idle gaps (the first right after start-up): each
    equal to the aggregated answer, from loaded KV, and in time: the first within
    ``first_max_s`` (a fresh decode's first forward is slow), the others within 2 s plus
    the aggregated server's time for the same prompt."""
    failures, times = [], []
    for i, (d, a) in enumerate(zip(lone, agg, strict=True)):
        if "error" in d:
            failures.append(f"lone request {i} failed: {d['error']}")
            continue
        limit = first_max_s if i == 0 else 2.0 + a.get("seconds", 0.0)
        times.append(f"{d['seconds']:.2f}s")
        if not same_answer(d, a):
            failures.append(f"lone request {i} answered otherwise than the aggregated server")
        if not d.get("loaded"):
            failures.append(f"lone request {i} was not answered from loaded KV (recomputed?)")
        if d["seconds"] > limit:
            failures.append(f"lone request {i} took {d['seconds']:.1f}s (limit {limit:.1f}s)")
    print(f"lone requests after idle gaps: {' '.join(times)} (first's limit {first_max_s:g}s)")
    return failures


def verdict(args: argparse.Namespace) -> int:
    disagg = json.loads(Path(args.disagg).read_text())
    agg = json.loads(Path(args.agg).read_text())
    agg, agg_lone = agg[: len(disagg)], agg[len(disagg) :]  # the reference of both runs
    lone = json.loads(Path(args.lone).read_text()) if args.lone else []
    handed = disagg + lone  # every request the decodes loaded for (their counters are totals)
    per_decode = [Path(p).read_text() for p in args.decode_metrics]
    metrics = "\n".join(per_decode)
    failures = []
    errors = [r["error"] for r in disagg if "error" in r]
    if errors:
        failures.append(f"{len(errors)} disaggregated requests failed, first: {errors[0]}")
    same = sum(1 for d, a in zip(disagg, agg, strict=False) if same_answer(d, a))
    agreement = 100.0 * same / len(disagg)
    copy = disagg[0]["answer"] is not None
    acc_d = accuracy(disagg) if copy else float("nan")
    acc_a = accuracy(agg) if copy else float("nan")
    if copy and acc_d < args.min_accuracy:
        failures.append(f"disaggregated accuracy {acc_d:.3f} < {args.min_accuracy}")
    if agreement < args.min_agreement:
        failures.append(f"agreement {agreement:.1f}% < {args.min_agreement}%")
    tokens_same, tokens = token_agreement(disagg, agg)
    print(f"token agreement: {tokens_same:.2f}% of the aggregated answers' {tokens} tokens")
    if tokens_same < args.min_token_agreement:
        failures.append(f"token agreement {tokens_same:.2f}% < {args.min_token_agreement}%")
    loaded_req = metric(metrics, "vllm:qaic_kv_loaded_requests_total")
    loaded_tok = metric(metrics, "vllm:qaic_kv_loaded_tokens_total")
    failed = metric(metrics, "vllm:qaic_kv_load_failures_total")
    local_hits = metric(metrics, "vllm:prefix_cache_hits_total")
    moved = metric(metrics, "vllm:qaic_kv_bytes_copied_total")
    direct = metric(metrics, "vllm:qaic_kv_direct_reads_total")
    prompt_tokens = sum(r.get("prompt_tokens", 0) for r in handed)
    print(
        f"decode connector: loaded_requests={loaded_req:.0f} loaded_tokens={loaded_tok:.0f} "
        f"load_failures={failed:.0f} direct_reads={direct:.0f} local_prefix_hits={local_hits:.0f} "
        f"prompt_tokens={prompt_tokens} handoffs={len(handed)} "
        f"bytes_per_request={moved / max(loaded_req, 1):.0f} "
        f"bytes_per_loaded_token={moved / max(loaded_tok, 1):.1f}"
    )
    if loaded_req < len(handed):
        failures.append(f"decode loaded KV for {loaded_req:.0f} of {len(handed)} requests")
    # Every prompt token except the one the decode recomputes came over the wire, unless a
    # local prefix hit already had it.
    if loaded_tok + local_hits < prompt_tokens - len(handed) or loaded_tok <= local_hits:
        failures.append(
            f"loaded tokens ({loaded_tok:.0f}) do not cover the prompts "
            f"({prompt_tokens}) beyond local prefix hits ({local_hits:.0f})"
        )
    if args.expect_peers:
        for i, text in enumerate(per_decode):
            peers = loads_by_peer(text)
            print(f"decode {i} loaded requests by prefill engine: {peers}")
            sources = sum(1 for n in peers.values() if n > 0)
            if sources < args.expect_peers:
                failures.append(f"decode {i} loaded from {sources} of {args.expect_peers} prefills")
    if args.lone:
        failures += lone_failures(lone, agg_lone, args.lone_first_max_s)
    for f in failures:
        print(f"FAIL: {f}")
    print(
        f"accuracy: disagg={acc_d:.3f} aggregated={acc_a:.3f} agreement={agreement:.1f}% "
        f"prompts={len(disagg)} transport={args.transport}"
    )
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--url", required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--task", choices=["copy", "text"], required=True)
    r.add_argument("--model-dir", default=None, help="tokenizer for text prompts")
    r.add_argument("--prompts-file", default=None, help="text prompts drawn before, kept")
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--concurrency", type=int, default=8)
    r.add_argument("--timeout", type=float, default=900)
    r.add_argument("--label", default="run")
    r.add_argument("--cache-salt", default=None, help="no prefix-cache sharing with other runs")
    r.add_argument("--out", required=True)
    r.add_argument("--offset", type=int, default=0, help="skip this many prompts of the set")
    r.add_argument(
        "--gaps", type=float, nargs="*", default=None,
        help="one request per gap, alone, after that many seconds idle (0: at once)",
    )  # fmt: skip
    r.add_argument("--decode-urls", nargs="*", default=[], help="with --gaps: decodes' metrics")
    help = "the prefill's URL: --url is the decode's, the legs llm-d's sidecar sends"
    r.add_argument("--sidecar", default=None, help=help)
    v = sub.add_parser("verdict")
    v.add_argument("--disagg", required=True)
    v.add_argument("--agg", required=True)
    v.add_argument("--decode-metrics", nargs="+", required=True, help="one file per decode")
    v.add_argument(
        "--expect-peers", type=int, default=0, help="each decode must load from this many prefills"
    )
    v.add_argument("--transport", required=True)
    v.add_argument("--lone", default=None, help="run --gaps results (prompts after --disagg's)")
    v.add_argument("--lone-first-max-s", type=float, default=10.0, help="the first's limit")
    v.add_argument("--min-accuracy", type=float, default=0.95)
    v.add_argument("--min-agreement", type=float, default=100.0, help="answers equal, %%")
    v.add_argument("--min-token-agreement", type=float, default=0.0, help="tokens equal, %%")
    args = parser.parse_args()
    if args.cmd == "run":
        asyncio.run(run(args))
        return 0
    return verdict(args)


if __name__ == "__main__":
    sys.exit(main())
