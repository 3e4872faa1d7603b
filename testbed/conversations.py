"""Multi-turn conversations through the proxy, against vLLM alone (``reuse_turns``).

N conversations of T turns, interleaved: every conversation's turn k at once, then turn
k + 1; every other conversation streams (its turn's ticket comes over the decode's side
channel, not in the answer). Each turn's prompt is the last one's, its answer and a new
question (the copy task's, on the shipped model). Every turn must equal vLLM's own answer
(the prefill alone, salted, beforehand). Per turn it reports what the prefill did with the
prompt tokens (vLLM's own ``prompt_tokens_by_source``: computed, loaded, found in its
cache), the bound reuse promises (the tokens past those the prompt shares with the last
turn's KV, plus a block), the decode's kept turns, and the prefill leg's time (the proxy's
Server-Timing: the client's TTFT on the first-token path) against vLLM alone's TTFT for
the same prompt.

Under pressure (``--pressure BLOCKS``), both engines' KV caches hold only ``BLOCKS`` blocks
and long background requests run beside every round of turns, so the decode evicts kept
turns and vLLM preempts requests; every answer must still equal vLLM alone's, and the run
reports kept, evicted and loaded turns, load failures (each a recompute) and preemptions.

Then the faults (``--faults``), each asked of the prefill as a router would, with a turn's
ticket from the decode: a history edited mid-way (the turn's whole blocks before the edit
load), a ticket used twice (the second read finds the turn given up), a decode killed
(SIGKILL) before its ticket is used. Each must answer vLLM's own first token.

    python -m testbed.conversations [--transport shm|nixl] [--no-prefix-caching]
        [--conversations 8] [--turns 4] [--no-reuse] [--faults] [--json OUT]
        [--scaled | --model DIR] [--compare --plot PNG] [--pressure 48 --dtype float32]

``--scaled``: a random model with the shipped model's word-level tokenizer (an answer's text
tokenizes back into its tokens) and 50x its compute, answering 128 tokens a turn, so that
the prefill's time shows. ``--model``: any model, e.g. a random one with its own
byte-level tokenizer (`scripts/make_random_model.py`), whose answers' text may tokenize
back into other tokens: reuse then loads the whole blocks the next prompt shares, and
computes the rest. ``--compare``: the same conversations with reuse and without, with
each turn's prefill-leg time as a ratio and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import requests

from testbed import copy_task
from testbed.live_servers import (
    ANSWER_TOKENS,
    MODEL,
    LiveRun,
    VllmServer,
    complete,
    kv_config,
    metric_samples,
)
from testbed.ports import free_port
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.ticket import parse_remote_prefill
from vllm_qaic_connector.transports.shm import reclaim_dead_segments

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")


@dataclass
class TurnReport:
    turn: int
    prompt_tokens: int = 0
    computed: int = 0
    loaded: int = 0
    cached: int = 0
    kept_turns: int = 0
    must_compute: list[int] = field(default_factory=list)  # per conversation
    mismatches: list[str] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)
    alone_ttft_ms: list[float] = field(default_factory=list)

    @property
    def since_last_kv(self) -> int:
        """The prompt tokens past those each shares with its conversation's last turn's KV."""
        return sum(self.must_compute)

    @property
    def within_bound(self) -> bool:
        """The prefill computed at most the tokens since the last turn, plus a block each."""
        return self.computed <= self.since_last_kv + BLOCK * len(self.prefill_ms)


def shared(kv: list[int], prompt: list[int]) -> int:
    """How many token ids ``prompt`` begins with that ``kv`` holds too."""
    return len(os.path.commonprefix([kv, prompt]))


def questions(conversations: int, turns: int, seed: int) -> list[list[str]]:
    """Each conversation's user parts: a first prompt, then questions that continue it."""
    rng = random.Random(f"conversations-{seed}")
    out = []
    for _ in range(conversations):
        first = copy_task.make_example(rng, prompt_tokens=120)[0]
        later = [copy_task.make_example(rng, prompt_tokens=60)[0] for _ in range(turns - 1)]
        out.append([first] + [" " + q.removeprefix(copy_task.BOS + " ") for q in later])
    return out


def background_prompts(count: int, seed: int) -> list[str]:
    """Long prompts (about 500 tokens) that run beside the turns under pressure."""
    rng = random.Random(f"background-{seed}")
    return [copy_task.make_example(rng, prompt_tokens=500)[0] for _ in range(count)]


@dataclass
class PressureReport:
    """What KV pressure did to a run (counter deltas over it)."""

    kept_turns: int
    evicted_turns: int
    turn_loads: int  # the prefill's loads: kept turns' KV
    turn_load_failures: int  # a kept turn gone (evicted): its history computed
    load_failures: int  # the decode's: each recomputed (kv_load_failure_policy)
    preemptions: int  # on either engine
    background_mismatches: list[str]


PRESSURE_METRICS = {
    "kept_turns": ("decode", "vllm:qaic_kv_kept_turns_total"),
    "evicted_turns": ("decode", "vllm:qaic_kv_evicted_turns_total"),
    "turn_loads": ("prefill", "vllm:qaic_kv_loaded_requests_total"),
    "turn_load_failures": ("prefill", "vllm:qaic_kv_load_failures_total"),
    "load_failures": ("decode", "vllm:qaic_kv_load_failures_total"),
    "preemptions": ("both", "vllm:num_preemptions_total"),
}


def pressure_counts(prefill: VllmServer, decode: VllmServer) -> dict[str, int]:
    servers = {"prefill": [prefill], "decode": [decode], "both": [prefill, decode]}
    return {
        name: int(sum(s.metric(metric, 0.0) for s in servers[where]))
        for name, (where, metric) in PRESSURE_METRICS.items()
    }


def by_source(url: str) -> dict[str, float]:
    text = requests.get(f"{url}/metrics", timeout=10).text
    samples = metric_samples(text, "vllm:prompt_tokens_by_source_total")
    return {s: sum(v for labels, v in samples if f'source="{s}"' in labels) for s in SOURCES}


def kept(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(v for _, v in metric_samples(text, "vllm:qaic_kv_kept_turns_total"))


# Every request's sampling: greedy, the copy task's answer length (``--scaled``: longer, and
# never a special token, which an answer's text would not show).
SAMPLING: dict[str, Any] = {"max_tokens": ANSWER_TOKENS, "temperature": 0.0}


def scaled_model(dest: Path) -> Path:
    """Random weights in a model 50x the shipped one's compute, with its tokenizer."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(MODEL)
    config.update(dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8))
    config.update(dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64))
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(MODEL / name, dest / name)
    return dest


async def ask(
    session: aiohttp.ClientSession, url: str, prompt: str, stream: bool = False, **extra: Any
) -> tuple[dict[str, Any], float]:
    """A greedy completion, and the prefill leg's milliseconds (Server-Timing), if any. A
    ``stream``'s events are joined into the answer a whole one would be."""
    body = {"model": "model", "prompt": prompt, **SAMPLING, **extra}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        timing = resp.headers.get("Server-Timing", "")
        if not stream:
            answer = await resp.json()
        else:
            lines = [line.strip() async for line in resp.content]
            events = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
            choices = [c for e in events for c in e["choices"]]
            last = {k: v for c in choices for k, v in c.items() if v is not None}
            text = "".join(c["text"] for c in choices)
            answer = {"choices": [{**last, "text": text}], "usage": events[-1]["usage"]}
        assert resp.status == 200, f"{url}: HTTP {resp.status} {answer}"
    return answer, float(timing.rpartition("dur=")[2] or 0)


def what_counts(answer: dict[str, Any]) -> tuple[Any, ...]:
    """What must equal vLLM alone's: the text, why it ended, and the usage."""
    choice, usage = answer["choices"][0], answer["usage"]
    counts = usage["prompt_tokens"], usage["completion_tokens"]
    return choice["text"], choice["finish_reason"], choice.get("stop_reason"), counts


async def ttft(session: aiohttp.ClientSession, url: str, prompt: str) -> float:
    t0 = time.monotonic()
    await ask(session, url, prompt, max_tokens=1, cache_salt="reference")
    return (time.monotonic() - t0) * 1e3


async def converse(
    proxy: str, prefill: str, decode: str, parts: list[list[str]], background: tuple[str, ...] = ()
) -> tuple[list[TurnReport], list[str]]:
    """vLLM alone's conversations first (salted; each turn's TTFT, then its answer), then
    the same turns through the proxy. Both interleaved: every conversation's turn at once,
    beside the ``background`` requests (their mismatches returned too)."""
    reports = [TurnReport(k + 1) for k in range(len(parts[0]))]
    background_mismatches: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        alone_bg = [ask(session, prefill, p, cache_salt="reference") for p in background]
        expected_bg = [what_counts(a) for a, _ in await asyncio.gather(*alone_bg)]
        expected: list[list[tuple[Any, ...]]] = [[] for _ in parts]
        histories = [""] * len(parts)
        turn_kv: list[list[int]] = [[] for _ in parts]  # the token ids the last turn's KV holds
        for k, report in enumerate(reports):
            prompts = [h + conv[k] for h, conv in zip(histories, parts, strict=True)]
            # Its prefix cache (where on) holds each conversation up to this question.
            report.alone_ttft_ms = await asyncio.gather(
                *(ttft(session, prefill, p) for p in prompts)
            )
            got = await asyncio.gather(
                *(
                    ask(session, prefill, p, cache_salt="reference", return_token_ids=True)
                    for p in prompts
                )
            )
            for i, (answer, _) in enumerate(got):
                choice = answer["choices"][0]
                expected[i].append(what_counts(answer))
                histories[i] = prompts[i] + choice["text"]
                # What reuse must compute: the prompt past the tokens it shares with the
                # last turn's KV (all of that, where the answer's text tokenizes back).
                prompt_ids = choice["prompt_token_ids"]
                report.must_compute.append(len(prompt_ids) - shared(turn_kv[i], prompt_ids))
                turn_kv[i] = prompt_ids + choice["token_ids"][:-1]
        histories = [""] * len(parts)
        for k, report in enumerate(reports):
            prompts = [h + conv[k] for h, conv in zip(histories, parts, strict=True)]
            sources, kept_before = by_source(prefill), kept(decode)
            # Every other conversation streams: its turn's ticket comes over the side channel.
            streamed = (ask(session, proxy, p, stream=i % 2 == 1) for i, p in enumerate(prompts))
            beside = (ask(session, proxy, p) for p in background)
            got, bg = await asyncio.gather(asyncio.gather(*streamed), asyncio.gather(*beside))
            background_mismatches += [
                f"round {k + 1}, background {i}: {what_counts(a)} != {want}"
                for i, ((a, _), want) in enumerate(zip(bg, expected_bg, strict=True))
                if what_counts(a) != want
            ]
            await asyncio.sleep(1.0)  # the last step's stats reach /metrics
            moved = {s: v - sources[s] for s, v in by_source(prefill).items()}
            report.computed, report.loaded, report.cached = (int(moved[s]) for s in SOURCES)
            report.kept_turns = int(kept(decode) - kept_before)
            for i, (answer, prefill_ms) in enumerate(got):
                text, usage = answer["choices"][0]["text"], answer["usage"]
                if (got_i := what_counts(answer)) != expected[i][k]:
                    report.mismatches.append(f"conversation {i}: {got_i} != {expected[i][k]}")
                report.prompt_tokens += usage["prompt_tokens"]
                report.prefill_ms.append(prefill_ms)
                histories[i] = prompts[i] + text
    return reports, background_mismatches


def first_token(prefill: VllmServer, prompt: str, **extra: Any) -> str:
    """A prefill leg (``kv_transfer_params`` in ``extra``) or vLLM alone: the token it
    answers; a handoff's staging is released at once (no decode comes for it)."""
    asked = {"model": "model", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, **extra}
    resp = requests.post(f"{prefill.url}/v1/completions", json=asked, timeout=60)
    assert resp.status_code == 200, f"the prefill failed: {resp.text[:300]}"
    body = resp.json()
    if isinstance(staged := body.get("kv_transfer_params"), dict) and not staged.get("error"):
        side_channel.release(parse_remote_prefill(staged), None, 5.0)
    return str(body["choices"][0]["text"])


def check_faults(
    prefill: VllmServer, decode: VllmServer, seed: int, prefix_caching: bool
) -> dict[str, Any]:
    """Each fault answers vLLM's own first token; returns the prefill's loads and failures.
    A ticket used twice is not read again where the prefill's prefix cache is on (a ticket
    is read once, as by sampling siblings), else its read fails."""
    (parts,) = questions(1, 2, seed + 1)
    names = ("vllm:qaic_kv_loaded_requests_total", "vllm:qaic_kv_load_failures_total")
    before = [prefill.metric(n, 0.0) for n in names]

    def turn(prompt: str) -> tuple[str, dict[str, Any]]:
        keep = {"keep_turn": True}  # kept as the proxy's named turns are: the ticket in the answer
        status, body = complete(decode.url, prompt, ANSWER_TOKENS, kv_transfer_params=keep)
        assert status == 200 and isinstance(body.get("kv_transfer_params"), dict), body
        return prompt + body["choices"][0]["text"], body["kv_transfer_params"]

    def with_turn(prompt: str, ticket: dict[str, Any], salt: str) -> str:
        """A prefill leg given the turn; salted, its own cache holds none of the prompt."""
        params = {"do_remote_decode": True, "earlier_turn": ticket}
        return first_token(prefill, prompt, kv_transfer_params=params, cache_salt=salt)

    def alone(prompt: str) -> str:
        return first_token(prefill, prompt, cache_salt="alone")

    history, ticket = turn(parts[0] + " f3")  # a turn of its own: a ticket is read once
    words = history.split(" ")
    words[len(words) // 2] = "f1" if words[len(words) // 2] != "f1" else "f2"
    edited = " ".join(words) + parts[1]
    assert with_turn(edited, ticket, "edited") == alone(edited), "history edited mid-way"
    # It loads the turn's whole blocks before the edit, and computes from there.
    edited_loads = prefill.metric(names[0], 0.0) - before[0]
    assert edited_loads == 1, f"the edited history loaded {edited_loads} times, not once"
    history, ticket = turn(parts[0])
    prompt = history + parts[1]
    assert with_turn(prompt, ticket, "once") == alone(prompt), "a ticket used once"
    history, ticket2 = turn(parts[0] + " f4")  # the decode steps: the used turn is gone
    assert with_turn(prompt, ticket, "twice") == alone(prompt), "a ticket used twice"
    decode.kill()
    decode.wait_gone(30)
    prompt = history + parts[1]
    assert with_turn(prompt, ticket2, "dead") == alone(prompt), "the decode killed"
    # What the decode's restart would do first (tests/live/test_faults.py restarts one).
    reclaim_dead_segments(f"qaic_kv_{decode.engine_id}_")
    loaded, failed = (prefill.metric(n, 0.0) - b for n, b in zip(names, before, strict=True))
    # Edited: its blocks before the edit. Used once: loaded. Twice: not read again, or a
    # failed read. The killed decode: a failed read, or a read of its memory still mapped
    # here (its turn's KV, sealed: no one can write it any more) before the worker notices
    # the death and unmaps it.
    reads = 3 if prefix_caching else 4
    assert loaded >= 1 and loaded + failed == reads, f"{loaded} loads, {failed} failures"
    return {"loaded": loaded, "load_failures": failed}


def run(
    transport: str,
    prefix_caching: bool,
    conversations: int,
    turns: int,
    reuse: bool,
    seed: int,
    faults: bool = False,
    model: Path = MODEL,
    pressure: int = 0,
    dtype: str | None = None,
) -> tuple[list[TurnReport], PressureReport | None]:
    """``pressure``: both engines' KV caches cut to that many blocks, and long requests
    beside the turns (`PressureReport`)."""
    args = ["--block-size", str(BLOCK), "--max-model-len", "1024"]
    # float32: in bf16 a token's KV from a decode step differs in its last bits from the
    # same KV from a prompt's pass, and a random model's near-ties turn on that.
    if model != MODEL:  # a random model's positions (RoPE) run past its config's
        args = ["--block-size", str(BLOCK), "--max-model-len", "4096", "--dtype", "float32"]
        args += ["--hf-overrides", json.dumps({"max_position_embeddings": 4096})]
    args += ["--dtype", dtype] if dtype else []
    args += ["--num-gpu-blocks-override", str(pressure)] if pressure else []
    block = args + ([] if prefix_caching else ["--no-enable-prefix-caching"])
    extra: dict[str, Any] = {"reuse_turns": reuse, "nixl_direct_reads": transport == "nixl"}
    with LiveRun("turns") as live:
        role = "kv_both" if reuse else "kv_consumer"
        prefill = live.vllm(
            "prefill", "0",
            kv_config("kv_producer", live.engine_id("p"), 0, transport, **extra),
            extra_args=block, model=model,
        )  # fmt: skip
        decode = live.vllm(
            "decode", "1",
            kv_config(role, live.engine_id("d"), free_port(), transport, **extra),
            extra_args=args, model=model,
        )  # fmt: skip
        prefill.wait_ready()
        decode.wait_ready()
        options = ("--reuse-turns",) if reuse else ()
        proxy = live.proxy([prefill.url], [decode.url], [decode.side_channel], options=options)
        proxy.wait_ready()
        parts = questions(conversations, turns, seed)
        background = tuple(background_prompts(3 if pressure else 0, seed))
        before = pressure_counts(prefill, decode)
        reports, bg_mismatches = asyncio.run(
            converse(proxy.url, prefill.url, decode.url, parts, background)
        )
        time.sleep(1.0)  # the last step's stats reach /metrics
        moved = {k: v - before[k] for k, v in pressure_counts(prefill, decode).items()}
        under = PressureReport(**moved, background_mismatches=bg_mismatches) if pressure else None
        if faults:
            found = check_faults(prefill, decode, seed, prefix_caching)
            print(f"[conversations] faults answered as vLLM alone: {found}")
    assert live.report is not None and live.report.clean, live.report and live.report.problems()
    return reports, under


def print_reports(reports: list[TurnReport], label: str) -> None:
    print(f"[conversations] {label}")
    print("turn  prompt  since-last-KV  computed  loaded  cached  kept  leg-ms  alone-ms  equal")
    for r in reports:
        leg, alone = median(r.prefill_ms), median(r.alone_ttft_ms)
        print(
            f"{r.turn:>4}  {r.prompt_tokens:>6}  {r.since_last_kv:>13}  {r.computed:>8}  "
            f"{r.loaded:>6}  {r.cached:>6}  {r.kept_turns:>4}  {leg:>6.1f}  {alone:>8.1f}  "
            f"{'yes' if not r.mismatches else len(r.mismatches)}"
        )


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def plot(runs: dict[str, list[TurnReport]], path: str) -> None:
    """Each turn's median prefill-leg time, per run, beside vLLM alone's TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, reports in runs.items():
        turns = [r.turn for r in reports]
        ax.plot(turns, [median(r.prefill_ms) for r in reports], marker="o", label=label)
    first = next(iter(runs.values()))
    alone = [median(r.alone_ttft_ms) for r in first]
    ax.plot([r.turn for r in first], alone, linestyle="--", label="vLLM alone (TTFT)")
    ax.set(xlabel="turn", ylabel="ms (median)", title="TTFT per turn through the proxy")
    ax.set_xticks([r.turn for r in first])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"[conversations] plot: {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--transport", choices=("shm", "nixl"), default="shm")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--no-reuse", action="store_true")
    p.add_argument("--compare", action="store_true", help="with reuse and without")
    p.add_argument("--scaled", action="store_true", help="a 50x model, 128-token answers")
    p.add_argument("--model", type=Path, help="another model's directory (its own tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG of each turn's time (with --compare)")
    p.add_argument("--pressure", type=int, default=0, help="KV cache blocks of each engine")
    p.add_argument("--dtype", default=None, help="vLLM's --dtype (default: the model's)")
    args = p.parse_args(argv)
    caching = "off" if args.no_prefix_caching else "on"
    setup = f"{args.conversations} conversations x {args.turns} turns, {args.transport}"
    model, scratch = args.model or MODEL, None
    if args.model:
        setup += f", {args.model.name}"
    elif args.scaled:
        scratch = Path(tempfile.mkdtemp(prefix="qaic-scaled-"))
        model = scaled_model(scratch)
        specials = {str(i): -100 for i in range(4) if i != 2}  # pad, bos, unk; eos ends
        SAMPLING.update(max_tokens=128, logit_bias=specials)
        setup += ", scaled model"
    modes = [True, False] if args.compare else [not args.no_reuse]
    runs: dict[str, list[TurnReport]] = {}
    ok = True
    try:
        for reuse in modes:
            reports, under = run(
                args.transport, not args.no_prefix_caching, args.conversations, args.turns,
                reuse, args.seed, args.faults and reuse, model, args.pressure, args.dtype,
            )  # fmt: skip
            if under is not None:
                print(f"[conversations] under pressure: {under}")
                ok &= not under.background_mismatches
            label = f"reuse {'on' if reuse else 'off'}"
            runs[label] = reports
            print_reports(reports, f"{setup}, prefill prefix caching {caching}, {label}")
            equal = all(not r.mismatches for r in reports)
            # Under pressure, evicted turns are computed: the bound holds on an idle pair.
            bounded = all(r.within_bound for r in reports[1:]) or not reuse or args.pressure > 0
            print(
                f"[conversations] every turn equal to vLLM alone: {equal}; within bound: {bounded}"
            )
            ok &= equal and bounded
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.compare:
        on, off = runs["reuse on"], runs["reuse off"]
        for a, b in zip(on, off, strict=True):
            ratio = median(a.prefill_ms) / max(median(b.prefill_ms), 1e-9)
            alone = median(a.prefill_ms) / max(median(a.alone_ttft_ms), 1e-9)
            print(f"[conversations] turn {a.turn}: TTFT with reuse {ratio:.2f}x of without, "
                  f"{alone:.2f}x of vLLM alone's")  # fmt: skip
        if args.plot:
            plot(runs, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: [asdict(r) for r in v] for k, v in runs.items()}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
