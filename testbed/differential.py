"""The proxy against vLLM itself over the requests clients send: a seeded generator draws
completions, chat and Responses requests over the parameters users choose (logprobs and
top_logprobs including 0, echo, max_tokens absent/null/1/small, min_tokens, stop strings and
ids, include_stop_str_in_output, ignore_eos, skip_special_tokens, seeded sampling, n > 1
greedy, streams with usage, token-id prompts, prompt lists), sends each through the proxy and
to the prefill alone (vLLM aggregated, salted away from the handoffs' cached blocks), and
compares whole answers: text, token ids, logprobs, finish reasons, usage, a refusal's status
and body; not ids or clocks. A second fleet, with a generation-config token cap, no prefix
caching and speculative decoding (n-gram drafts by default), runs the same.

    python -m testbed.differential --requests 500 --seed 1   # make differential
    python -m testbed.differential --model DIR --speculative-config JSON --requests 30

Prints each difference (the request, both answers) and exits non-zero on any.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import requests

from testbed.live_servers import (
    MODEL,
    LiveRun,
    Server,
    VllmServer,
    copy_prompts,
    free_port,
    kv_config,
    token_ids,
    wait_all_ready,
)
from testbed.proxy_clients import CHAT_TEMPLATE, _answer, _api_answer

Request = tuple[str, dict[str, Any]]
KEPT, LOADED = "vllm:qaic_kv_kept_turns_total", "vllm:qaic_kv_loaded_requests_total"
CAP = 5  # the capped fleet's --override-generation-config max_new_tokens
# The capped fleet's --speculative-config: drafts with no KV of their own, any model.
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2})  # fmt: skip
# Floats (logprobs) may differ in their last bits: a handoff's decode computes its first
# step over loaded KV where vLLM alone computes it inside the prompt's pass (float32: ~1e-7
# apart on a random model; exact on the shipped one). Every token and text stays exact.
LOGPROB_TOL = 1e-4


def maybe(rng: random.Random, p: float = 0.5) -> bool:
    return rng.random() < p


def draw(
    rng: random.Random, prompt: str, answer: str, ids: list[int], seeded: bool = True
) -> Request:
    """One request over the space clients choose from; ``answer`` is the prompt's expected
    answer (stop strings that do occur come from it), ``ids`` its token ids. ``seeded``:
    seeded sampling among them (not under speculative decoding, where vLLM alone answers a
    seeded request otherwise once its prefix cache holds part of the prompt: measured with
    n-gram drafts, 128 of 150 tokens cached, the same server; a handoff's decode is such a
    cache)."""
    words = answer.split()
    body: dict[str, Any] = {"model": "model"}
    path = rng.choice(["/v1/completions"] * 3 + ["/v1/chat/completions"] * 2 + ["/v1/responses"])
    if path == "/v1/responses":
        body["input"] = prompt
        if maybe(rng, 0.7):
            body["max_output_tokens"] = rng.choice([1, 2, 4, 8, 12])
        body["temperature"] = 0.0
        body["stream"] = maybe(rng)
        return path, body
    chat = path == "/v1/chat/completions"
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = rng.choice([prompt, prompt, ids, [prompt, prompt + " s1"]])
    limit = rng.choice(["absent", "null", 1, 2, 3, 6, 12])
    key = rng.choice(["max_tokens", "max_completion_tokens"]) if chat else "max_tokens"
    if limit != "absent":
        body[key] = None if limit == "null" else limit
    bounded = isinstance(limit, int) or not chat  # completions: vLLM's default 16
    if maybe(rng, 0.3):
        body["min_tokens"] = rng.choice([0, 1, 3])
    if maybe(rng, 0.35):
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.choice([0, 1, 3])
        else:
            body["logprobs"] = rng.choice([0, 0, 1, 3])
    if not chat and maybe(rng, 0.15):
        body["echo"] = True
    if words and maybe(rng, 0.3):
        body["stop"] = rng.choice([[rng.choice(words)], rng.choice(words), ["]"], []])
        if maybe(rng):
            body["include_stop_str_in_output"] = maybe(rng)
    if maybe(rng, 0.15):
        body["stop_token_ids"] = [rng.choice(ids[-6:])]
    if bounded and maybe(rng, 0.15):
        body["ignore_eos"] = True
    if maybe(rng, 0.15):
        body["skip_special_tokens"] = maybe(rng)
    # Seeded sampling, or several greedy choices. Not both: vLLM 0.32 on CPU kills its
    # engine when a seeded request's sampled token is discarded (a sibling's partial
    # prefill: "CPU Generator does not use offset" in _bookkeeping_sync), vLLM alone too.
    if seeded and maybe(rng, 0.3):
        body["temperature"], body["seed"] = rng.choice([0.5, 1.0]), rng.randrange(1000)
    else:
        body["temperature"] = 0.0
        if maybe(rng, 0.15):
            body["n"] = rng.choice([2, 3])
    if maybe(rng, 0.4):
        body["stream"] = True
        if maybe(rng, 0.6):
            body["stream_options"] = {"include_usage": True}
            if maybe(rng, 0.3):
                body["stream_options"]["continuous_usage_stats"] = True
    if not chat and maybe(rng, 0.2):
        body["return_token_ids"] = True
    return path, body


def requests_of(
    rng: random.Random, n: int, url: str, label: str, seeded: bool = True
) -> Iterator[Request]:
    """``n`` requests, each on a fresh prompt (no prefix-cache hit between them)."""
    for prompt, answer in copy_prompts(n, f"{label}-{rng.randrange(1 << 30)}"):
        yield draw(rng, prompt, answer, token_ids(url, prompt), seeded)


def said(path: str, got: Any) -> str | None:
    """The text of an answer's one choice (whole or streamed), or None."""
    if path == "/v1/responses":
        if "text" in got:  # a stream's
            return str(got["text"])
        parts = [c for o in got.get("output", []) for c in o.get("content") or []]
        return "".join(c.get("text", "") for c in parts)
    choices = got.get("choices")
    if not choices or len(choices) != 1:
        return None
    choice = choices[0]  # a list, or a stream's choices by index
    text = choice.get("text") if path == "/v1/completions" else None
    message = choice.get("message") or choice.get("delta") or {}
    return text if isinstance(text, str) else message.get("content")


def follow_up(rng: random.Random, request: Request, got: Any) -> Request | None:
    """The next turn of ``request``'s conversation, as users send it: the history, vLLM's
    answer and a new message, with the same options; None where it has no next turn (token
    ids, prompt lists, n > 1, a refusal)."""
    path, body = request
    text = said(path, got) if "status" not in got else None
    new = " " + " ".join(rng.choice(["more", "again", "s1", "copy", "then"]) for _ in range(4))
    if text is None:
        return None
    if path == "/v1/completions" and isinstance(body["prompt"], str):
        return path, {**body, "prompt": body["prompt"] + text + new}
    history = body.get("messages") or body.get("input")
    if isinstance(history, str):
        history = [{"role": "user", "content": history}]
    if path == "/v1/completions" or not isinstance(history, list):
        return None
    turns = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": new}]
    return path, {**body, ("input" if path == "/v1/responses" else "messages"): turns}


def answer(url: str, path: str, body: dict[str, Any]) -> Any:
    """vLLM's answer without what differs every time, or a refusal's status and body. Not
    compared: whether a stream's completion counts never fall, which vLLM's own streams
    break now and then (events it merged when its client lagged; n > 1 interleaved)."""
    try:
        got = (_api_answer if path == "/v1/responses" else _answer)(url, path, body)
        if isinstance(got, dict):
            got.pop("completion_tokens_never_fall", None)
        return got
    except AssertionError:  # not 200: the refusal itself is the answer to compare
        r = requests.post(url + path, json=body, timeout=120)
        try:
            return {"status": r.status_code, "body": r.json()}
        except ValueError:
            return {"status": r.status_code, "body": r.text}


def difference(a: Any, b: Any, at: str = "") -> str | None:
    """Where ``a`` and ``b`` first differ, and how, shortly; None where they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if (d := difference(a.get(k), b.get(k), f"{at}.{k}")) is not None:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b, strict=True))
                     if (d := difference(x, y, f"{at}[{i}]")) is not None), None)  # fmt: skip
    if isinstance(a, float) and isinstance(b, float) and abs(a - b) <= LOGPROB_TOL:
        return None
    return None if a == b else f"{at or '.'}: proxy {str(a)[:160]!r} vLLM {str(b)[:160]!r}"


def shown(body: dict[str, Any]) -> str:
    """A request without its prompt's text (long, and the seed makes it again)."""
    short = {k: v for k, v in body.items() if k not in ("prompt", "messages", "input")}
    return json.dumps(short)


def alone(prefill: VllmServer, path: str, body: dict[str, Any]) -> Any:
    """vLLM's own answer: the prefill serving it, salted away from every cached block."""
    return answer(prefill.url, path, {**body, "cache_salt": f"ref-{time.monotonic_ns()}"})


def compare(proxy: Server, prefill: VllmServer, reqs: Iterator[Request],
            say: Callable[[str], None], rng: random.Random) -> list[dict[str, Any]]:  # fmt: skip
    """Every request through the proxy and to the prefill alone; the differences. After a
    request, ``rng`` may draw its conversation's next turn instead of the next request."""
    differences, turn = [], None
    for i, drawn in enumerate(reqs, 1):
        path, body = turn or drawn  # a conversation's next turn, where one was drawn
        got = answer(proxy.url, path, body)
        want = alone(prefill, path, body)
        # vLLM alone may answer a request differently from one time to the next (a streamed
        # echo with logprobs and n > 1 drops a choice now and then: a KeyError in its
        # API server): the proxy's answer counts as right where vLLM itself gives it too.
        for _ in range(3 if difference(got, want) else 0):
            if (again := alone(prefill, path, body)) == got:
                say(f"vLLM itself answers {path} {shown(body)} either way")
                want = again
                break
        if (where := difference(got, want)) is not None:
            differences.append({"path": path, "body": body, "proxy": got, "vllm": want})
            say(f"DIFFERENT {path} {shown(body)}\n  {where}")
        if i % 25 == 0:
            say(f"{i} compared, {len(differences)} different")
        turn = follow_up(rng, (path, body), got) if maybe(rng, 0.4) else None
    return differences


def fleet(
    run: LiveRun, label: str, cores: tuple[str, str], extra: list[str], model: Path = MODEL,
    reuse: bool = False,
) -> tuple:  # fmt: skip
    """A prefill and a decode of ``model``, started with ``extra``; ``reuse``: the decode
    keeps turns for the next turn's prefill (``reuse_turns``)."""
    roles = ("kv_producer", "kv_both" if reuse else "kv_consumer")
    kv = {role: kv_config(role, run.engine_id(label + role[3]), free_port(), reuse_turns=reuse)
          for role in roles}  # fmt: skip
    prefill = run.vllm(f"{label}p", cores[0], kv[roles[0]], extra_args=extra, model=model)
    decode = run.vllm(f"{label}d", cores[1], kv[roles[1]], extra_args=extra, model=model)
    return prefill, decode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=500, help="per fleet")
    p.add_argument("--seed", type=int, default=1)
    other = "another model (scripts/make_random_model.py), served in float32"
    p.add_argument("--model", type=Path, default=MODEL, help=other)
    spec = "the capped fleet's --speculative-config (JSON; none: off), vLLM alone's too"
    p.add_argument("--speculative-config", default=NGRAM, help=spec)
    p.add_argument("--fleet", choices=FLEETS, default=None, help="only this fleet")
    a = p.parse_args(argv)
    speculative = None if a.speculative_config == "none" else a.speculative_config
    found = run_differential(a.requests, a.seed, print, a.model, speculative, a.fleet)
    return 1 if found else 0


FLEETS = ("plain", "capped")


def run_differential(
    n: int, seed: int, say: Callable[[str], None], model: Path = MODEL,
    speculative: str | None = NGRAM, only: str | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Both fleets (vLLM's defaults; a generation-config cap, ``speculative`` decoding),
    ``n`` requests each; ``only``: that one of `FLEETS`."""
    chat = ["--chat-template", CHAT_TEMPLATE]  # the model has none: the text as it is
    if model != MODEL:  # random weights: float32, as the harness serves them (no near-ties)
        chat += ["--dtype", "float32"]
    # The capped fleet also runs without prefix caching (n > 1 siblings then share no block).
    cap = [*chat, "--override-generation-config", json.dumps({"max_new_tokens": CAP}),
           "--no-enable-prefix-caching"]  # fmt: skip
    if speculative:
        cap += ["--speculative-config", speculative]
    differences: list[dict[str, Any]] = []
    with LiveRun("differential") as run:
        starts = {
            "plain": lambda: fleet(run, "plain", ("0", "1"), chat, model),
            "capped": lambda: fleet(run, "capped", ("0", "1"), cap, model, reuse=True),
        }
        fleets = {name: start() for name, start in starts.items() if only in (None, name)}
        wait_all_ready(*(s for f in fleets.values() for s in f))
        for name, (prefill, decode) in fleets.items():
            options = ("--reuse-turns",) if name == "capped" else ()
            proxy = run.proxy([prefill.url], [decode.url], [decode.side_channel], options=options)
            wait_all_ready(proxy)
            rng = random.Random(f"{seed}-{name}")
            say(f"[differential] fleet {name}: {n} requests, seed {seed}")
            seeded = name == "plain" or not speculative
            reqs = requests_of(rng, n, prefill.url, name, seeded)
            found = compare(proxy, prefill, reqs, say, rng)
            say(f"[differential] fleet {name}: {n} compared, {len(found)} different")
            if name == "capped":  # the next turns' loads of the turns the decode kept
                kept, loaded = decode.metric(KEPT, 0.0), prefill.metric(LOADED, 0.0)
                say(f"[differential] fleet {name}: {kept:.0f} turns kept, {loaded:.0f} loaded")
            differences += found
        run.keep |= bool(differences)  # the engines' logs say why (a crash: its stack)
    return differences


if __name__ == "__main__":
    sys.exit(main())
