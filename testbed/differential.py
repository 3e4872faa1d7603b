"""The proxy against vLLM itself over the requests clients send: a seeded generator draws
conversations of completions, chat, Responses and Anthropic Messages requests, sends each
through the proxy and to the prefill alone (vLLM aggregated, salted away from the handoffs'
cached blocks), and compares whole answers: text, token ids, logprobs, finish reasons,
usage, a refusal's status and body; not ids or clocks. Where vLLM itself fails a request
(HTTP 5xx), the proxy's failure (502, naming the leg) is the same answer.

What it draws (each option with its own probability, so that 30 requests still see most):
- the API (completions 3 : chat 2 : Responses 1 : Messages 1), streamed or not, with usage
  (continuous too); after a request, often its conversation's next turn (the history,
  the proxy's answer, a new message, the same options);
- prompts of the copy task: 100-400 tokens, long ones (500-1,000 of a 1,024-token
  context), near-context ones (prompt + max_tokens at, one under and one over the context),
  token-id prompts and prompt lists;
- token limits (absent, null, 1, small), min_tokens, stop strings and ids,
  include_stop_str_in_output, ignore_eos, skip_special_tokens, logprobs and top_logprobs
  (0 too), echo, return_token_ids, prompt_logprobs, truncate_prompt_tokens (in and over
  range), n > 1 greedy, seeded sampling, top_p / top_k / min_p, presence, frequency and
  repetition penalties, logit_bias, a client's cache_salt;
- system messages (chat, Messages' ``system``, Responses' ``instructions``), a chat
  template of the request's own (text as is, or one that marks roles: servers run with
  --trust-request-chat-template), tools with each tool_choice (without a tool parser vLLM
  refuses all but "none": its 400), guided choices (``structured_outputs``; JSON
  ``response_format`` only on a model whose tokenizer spells JSON: the shipped one's
  cannot, and vLLM answers 500);
- what else clients send: an unknown model name (vLLM's 404), an ``Authorization`` header
  (servers run without --api-key: it passes harmlessly), forged ``kv_transfer_params``,
  ``keep_turn``, ``turn_id`` and ``earlier_turn`` (the answer must be vLLM's without them),
  and clients that close a stream after its first event.

And it sees the transfers: every answer through the proxy must carry no ticket (a non-null
``kv_transfer_params`` at any depth, whole or streamed); the first fleet's decode runs
``kv_load_failure_policy: fail`` (a failed load is an error answer, found at its request;
a decode that keeps turns must recompute); after each fleet's run the decode's loaded
requests must have grown by the handoffs the requests imply (`handoffs`), with no load
failure, and the fleet must be idle again (no request running, no staging page held;
without kept turns, no decode block held), which a client's disconnect must not break.

Two fleets: vLLM's defaults; a generation-config token cap, no prefix caching, speculative
decoding (n-gram drafts by default), kept turns and a server chat template that marks roles.
``--concurrency N``: N conversations in flight at once, each request compared with vLLM
alone as it is answered (the shipped model is float32-exact across batches).
``--break-transfers`` gives each decode another side-channel key than its prefill's, so
every ticket fails: the run must report it.

    python -m testbed.differential --requests 500 --seed 1 --concurrency 4  # make differential
    python -m testbed.differential --model DIR --speculative-config JSON --requests 30

Prints each difference (the request, both answers) and exits non-zero on any.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from testbed import copy_task
from testbed.live_servers import (
    MODEL,
    LiveRun,
    Server,
    VllmServer,
    free_port,
    kv_config,
    poll_until,
    token_ids,
    wait_all_ready,
)
from testbed.proxy_clients import (
    CHAT_TEMPLATE,
    PER_ANSWER,
    _delta_text,
    _merged_stream,
    _scrubbed,
)
from testbed.shipped_model import TINY
from vllm_qaic_proxy import apis, first_token, prompt_lists

KEPT, LOADED = "vllm:qaic_kv_kept_turns_total", "vllm:qaic_kv_loaded_requests_total"
LOAD_FAILURES = "vllm:qaic_kv_load_failures_total"
LEFT = "client-left-"  # the request id of a request whose client leaves early
# An answer's ids in its first event: the Responses API names its request itself (resp_...),
# whatever X-Request-Id says, and the decode's log names the request by that id.
ANSWER_IDS = re.compile(rb'"id":\s*"([^"]+)"')
PAGES_IN_USE = "vllm:qaic_kv_staging_pages_in_use"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CAP = 5  # the capped fleet's --override-generation-config max_new_tokens
CONTEXT = TINY.max_model_len
# The capped fleet's --speculative-config: drafts with no KV of their own, any model.
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2})  # fmt: skip
# A chat template that marks roles (with words of the shipped model's vocabulary).
ROLE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }} f0 "
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }} f1 {% else %}{{ m['content'] }}"
    "{% endif %}{% endfor %}"
)
# Floats (logprobs) may differ in their last bits: a handoff's decode computes its first
# step over loaded KV where vLLM alone computes it inside the prompt's pass (float32: ~1e-7
# apart on a random model; exact on the shipped one). Every token and text stays exact.
LOGPROB_TOL = 1e-4
# What a client may forge; vLLM alone answers the request without them.
FORGED = ("kv_transfer_params", "keep_turn", "turn_id", "earlier_turn")
PATHS = ["/v1/completions"] * 3 + ["/v1/chat/completions"] * 2 + ["/v1/responses", "/v1/messages"]
VOCAB = copy_task.SYMBOLS[:20] + copy_task.FILLERS[:20]


def maybe(rng: random.Random, p: float = 0.5) -> bool:
    return rng.random() < p


@dataclass
class Request:
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    disconnect: bool = False  # the client closes the stream after its first event

    def shown(self) -> str:
        """The request without its prompt's text (long, and the seed makes it again)."""
        short = {k: v for k, v in self.body.items() if k not in ("prompt", "messages", "input")}
        extra = {"headers": list(self.headers)} if self.headers else {}
        return json.dumps({**short, **extra, **({"disconnect": True} if self.disconnect else {})})


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str  # the copy task's expected answer (stop strings that occur come from it)
    ids: list[int]


def forged(rng: random.Random, side_channel: str) -> dict[str, Any]:
    """What a hostile client adds to a body: a ticket, a request to stage or keep a turn,
    an earlier turn naming blocks of an engine of the fleet."""
    host, port = side_channel.rsplit(":", 1)
    ticket = {"do_remote_prefill": True, "remote_engine_id": "forged", "remote_host": host,
              "remote_port": int(port), "remote_request_id": "forged", "num_tokens": 64,
              "staging_offset": 0, "staged_layout": "x", "staged_block_size": 128,
              "incarnation": "x", "generation": 1, "prompt_hash": "0" * 16, "lease_s": 60.0,
              "expires_at": time.time() + 60, "block_ids": [0, 1, 2]}  # fmt: skip
    return rng.choice([
        {"kv_transfer_params": {"do_remote_decode": True}},
        {"kv_transfer_params": ticket},
        {"kv_transfer_params": {"keep_turn": True, "turn_id": "forged"}},
        {"kv_transfer_params": {"do_remote_decode": True, "earlier_turn": ticket}},
        {"keep_turn": True, "turn_id": "forged", "earlier_turn": ticket},
    ])  # fmt: skip


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def draw(
    rng: random.Random, prompt: Prompt, path: str, seeded: bool, grammar: bool,
    side_channel: str,
) -> Request:  # fmt: skip
    """One request over the space clients choose from, on ``prompt``. ``seeded``: seeded
    sampling among them (not under speculative decoding, where vLLM alone answers a seeded
    request otherwise once its prefix cache holds part of the prompt: measured with n-gram
    drafts, 128 of 150 tokens cached, the same server; a handoff's decode is such a cache).
    ``grammar``: the model's tokenizer spells JSON (JSON response formats drawn).
    ``side_channel``: an engine's, for forged tickets."""
    body: dict[str, Any] = {"model": "model"}
    if path == "/v1/responses":
        body["input"] = prompt.text
        if maybe(rng, 0.7):
            body["max_output_tokens"] = rng.choice([1, 2, 4, 8, 12])
        if maybe(rng, 0.25):
            body["instructions"] = words(rng, rng.randint(2, 8))
        if maybe(rng, 0.15):
            body["top_p"] = rng.choice([0.5, 0.9])
        body["temperature"] = 0.0
        body["stream"] = maybe(rng)
    elif path == "/v1/messages":
        body["messages"] = [{"role": "user", "content": prompt.text}]
        body["max_tokens"] = rng.choice([1, 2, 4, 8, 12, 30])  # required by the API
        if maybe(rng, 0.3):
            system = words(rng, rng.randint(2, 8))
            body["system"] = rng.choice([system, [{"type": "text", "text": system}]])
        if maybe(rng, 0.2):
            body["stop_sequences"] = [rng.choice(prompt.answer.split())]
        if maybe(rng, 0.15):
            body.update(top_p=rng.choice([0.5, 0.9]), top_k=rng.choice([1, 5]))
        body["temperature"] = 0.0
        body["stream"] = maybe(rng)
    else:
        openai_options(rng, body, prompt, path == "/v1/chat/completions", seeded, grammar)
    client_options(rng, body, side_channel)
    headers = {"Authorization": f"Bearer sk-{secrets.token_hex(8)}"} if maybe(rng, 0.15) else {}
    return Request(path, body, headers, disconnect=bool(body.get("stream")) and maybe(rng, 0.1))


def openai_options(
    rng: random.Random, body: dict[str, Any], prompt: Prompt, chat: bool, seeded: bool,
    grammar: bool,
) -> None:  # fmt: skip
    """Completions' and chat's options (the one OpenAI request shape vLLM extends)."""
    ids = prompt.ids
    if chat:
        body["messages"] = [{"role": "user", "content": prompt.text}]
        if maybe(rng, 0.25):
            body["messages"].insert(0, {"role": "system", "content": words(rng, 6)})
        if maybe(rng, 0.1):
            body["chat_template"] = rng.choice([CHAT_TEMPLATE, ROLE_TEMPLATE])
    else:
        body["prompt"] = rng.choice([prompt.text, prompt.text, ids,
                                     [prompt.text, prompt.text + " s1"]])  # fmt: skip
    limit = rng.choice(["absent", "null", 1, 2, 3, 6, 12])
    key = rng.choice(["max_tokens", "max_completion_tokens"]) if chat else "max_tokens"
    if not chat and maybe(rng, 0.06):  # at the context's edge: one under, at, one over
        body["prompt"], limit = prompt.text, CONTEXT - len(ids) + rng.choice([-1, 0, 1])
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
    if maybe(rng, 0.08):
        body["prompt_logprobs"] = rng.choice([0, 1, 3])
    if maybe(rng, 0.08):  # the prompt's last tokens; more than the context: vLLM's 400
        body["truncate_prompt_tokens"] = rng.choice([len(ids) // 2, len(ids) - 1, -1, 2 * CONTEXT])
    answer = prompt.answer.split()
    if maybe(rng, 0.3):
        body["stop"] = rng.choice([[rng.choice(answer)], rng.choice(answer), ["]"], []])
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
        if maybe(rng):
            body.update(top_p=rng.choice([0.3, 0.8]), top_k=rng.choice([2, 5, -1]),
                        min_p=rng.choice([0.0, 0.05, 0.2]))  # fmt: skip
    else:
        body["temperature"] = 0.0
        if maybe(rng, 0.15):
            body["n"] = rng.choice([2, 3])
        if maybe(rng, 0.08):  # greedy: they pass through and change nothing
            body.update(top_p=0.5, top_k=3, min_p=0.1)
    if maybe(rng, 0.12):
        penalty = rng.choice(["presence_penalty", "frequency_penalty", "repetition_penalty"])
        body[penalty] = rng.choice(
            [0.8, 1.3, 2.0] if penalty == "repetition_penalty" else [-1.0, 1.5]
        )
    if maybe(rng, 0.1):  # a token of the answer's string, banned or favoured
        body["logit_bias"] = {str(rng.choice(ids)): rng.choice([-100, -5, 5, 100])}
    if maybe(rng, 0.08):
        structure(rng, body, answer, chat, grammar)
    if maybe(rng, 0.4):
        body["stream"] = True
        if maybe(rng, 0.6):
            body["stream_options"] = {"include_usage": True}
            if maybe(rng, 0.3):
                body["stream_options"]["continuous_usage_stats"] = True
    if not chat and maybe(rng, 0.2):
        body["return_token_ids"] = True


def structure(
    rng: random.Random, body: dict[str, Any], answer: list[str], chat: bool, grammar: bool
) -> None:
    """Tools (chat) or a constrained output: a guided choice, JSON where the model can."""
    if chat and maybe(rng):
        parameters = {"type": "object", "properties": {"s": {"type": "string"}}}
        function = {"name": "copy", "description": "copy it", "parameters": parameters}
        body["tools"] = [{"type": "function", "function": function}]
        choice = rng.choice(
            ["none", "auto", "required", {"type": "function", "function": {"name": "copy"}}]
        )
        body["tool_choice"] = choice
    elif grammar and maybe(rng):
        schema = {"type": "object", "properties": {"s": {"type": "string"}}}
        body["response_format"] = rng.choice([
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "copy", "schema": schema}},
        ])  # fmt: skip
    else:
        body["structured_outputs"] = {"choice": [answer[0], " ".join(answer[:3]), "s1"]}


def client_options(rng: random.Random, body: dict[str, Any], side_channel: str) -> None:
    """What any API's client may add: its own cache salt, a model it thinks is served,
    fields that only engines and routers should send."""
    if maybe(rng, 0.1):
        body["cache_salt"] = f"client-{rng.randrange(4)}"
    if maybe(rng, 0.04):
        body["model"] = "no-such-model"
    if maybe(rng, 0.08):
        body.update(forged(rng, side_channel))


def prompt_of(rng: random.Random, url: str) -> Prompt:
    """A fresh copy-task prompt (no prefix-cache hit between two): mostly 100-400 tokens,
    now and then 500-1,000."""
    tokens = rng.randint(500, 1000) if maybe(rng, 0.15) else None
    text, answer = copy_task.make_example(rng, prompt_tokens=tokens)
    return Prompt(text, answer, token_ids(url, text))


def said(path: str, got: Any) -> str | None:
    """The text of an answer's one choice (whole or streamed), or None."""
    if path in ("/v1/responses", "/v1/messages"):
        if "text" in got:  # a stream's
            return str(got["text"])
        if path == "/v1/messages":
            return "".join(c.get("text", "") for c in got.get("content") or [])
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
    """The next turn of ``request``'s conversation, as users send it: the history, the
    answer and a new message, with the same options; None where it has no next turn (token
    ids, prompt lists, n > 1, a refusal, a client that left)."""
    path, body = request.path, request.body
    text = said(path, got) if not refused(got) and not request.disconnect else None
    new = " " + " ".join(rng.choice(["more", "again", "s1", "copy", "then"]) for _ in range(4))
    if text is None:
        return None
    if path == "/v1/completions" and isinstance(body["prompt"], str):
        return Request(path, {**body, "prompt": body["prompt"] + text + new}, request.headers)
    history = body.get("messages") or body.get("input")
    if isinstance(history, str):
        history = [{"role": "user", "content": history}]
    if path == "/v1/completions" or not isinstance(history, list):
        return None
    turns = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": new}]
    key = "input" if path == "/v1/responses" else "messages"
    return Request(path, {**body, key: turns}, request.headers)


def tickets_in(value: Any) -> Iterator[str]:
    """Every non-null ``kv_transfer_params`` in an answer, at any depth."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "kv_transfer_params" and v is not None:
                yield json.dumps(v)[:200]
            else:
                yield from tickets_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from tickets_in(v)


def answer(url: str, request: Request, body: dict[str, Any]) -> tuple[Any, list[str]]:
    """vLLM's answer to ``body`` without what differs every time (a stream's events summed:
    where they break is not part of it), or a refusal's status and body; and the tickets it
    carried. Not compared: whether a stream's completion counts never fall, which vLLM's own
    streams break now and then (events it merged when its client lagged; n > 1
    interleaved)."""
    path, api = request.path, request.path in ("/v1/responses", "/v1/messages")
    post = {"json": body, "headers": request.headers, "stream": True, "timeout": 300}
    with requests.post(url + path, **post) as r:  # type: ignore[arg-type]
        if r.status_code != 200:
            try:
                error = r.json()
            except ValueError:
                error = r.text
            return {"status": r.status_code, "body": error}, list(tickets_in(error))
        if not body.get("stream"):
            whole = r.json()
            got = _scrubbed(whole) if api else {k: v for k, v in whole.items()
                                                if k not in PER_ANSWER}  # fmt: skip
            return got, list(tickets_in(whole))
        lines = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    events = [json.loads(line) for line in lines if line.startswith(b"{")]
    tickets = [t for e in events for t in tickets_in(e)]
    if api:
        texts = [t for e in events if (t := _delta_text(e)) is not None]
        others = [_scrubbed(e) for e in events if _delta_text(e) is None]
        return {"text": "".join(texts), "events": others}, tickets
    merged = _merged_stream(events)
    merged.pop("completion_tokens_never_fall", None)
    merged["ends_with_done"] = lines[-1:] == [b"[DONE]"]
    return merged, tickets


def leave_early(url: str, request: Request) -> tuple[Any, list[str]]:
    """A client that reads a stream's first event and closes it; a refusal as it came. Its
    request id starts with `LEFT`, and its first event names the answer's ids: the decode's
    log names one of them where its load failed (the proxy released the staging when the
    client went; the request was aborted anyway)."""
    headers = {**request.headers, "X-Request-Id": f"{LEFT}{secrets.token_hex(4)}"}
    post = {"json": request.body, "headers": headers, "stream": True, "timeout": 300}
    first = b""
    with requests.post(url + request.path, **post) as r:  # type: ignore[arg-type]
        if r.status_code != 200:
            return {"status": r.status_code}, []
        for chunk in r.iter_content(chunk_size=None):
            first += chunk
            if b"\n\n" in first:  # a whole event
                break
    return {"left": True}, [i.decode() for i in ANSWER_IDS.findall(first)]


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


def refused(got: Any) -> bool:
    """Whether ``got`` is an HTTP error's status and body (a Responses answer's own status
    is a word)."""
    return isinstance(got.get("status"), int)


def failed(got: Any) -> bool:
    """Whether ``got`` is a server's failure (HTTP 5xx), not a refusal of the request."""
    return refused(got) and got["status"] >= 500


def alone(prefill: VllmServer, request: Request) -> Any:
    """vLLM's own answer: the prefill serving it without what clients may forge, salted
    away from every cached block."""
    body = {k: v for k, v in request.body.items() if k not in FORGED}
    return answer(prefill.url, request, {**body, "cache_salt": f"ref-{time.monotonic_ns()}"})[0]


def handoffs(request: Request, got: Any) -> tuple[int, int]:
    """The fewest and most loads of prompt KV that the decode makes for ``request``,
    answered ``got`` through the proxy: none for a refusal, or where the decode answers
    alone (prompt logprobs) or the prefill's token was the answer (completions: one token);
    one per prompt otherwise (n > 1: up to n, when siblings share no cached block); up to
    one per prompt for a client that left."""
    path, body = request.path, request.body
    several = prompt_lists.prompts(body) if path == "/v1/completions" else None
    bodies = [{**body, "prompt": p} for p in several] if several else [body]
    most_each = body["n"] if isinstance(body.get("n"), int) and body["n"] > 1 else 1
    if request.disconnect:
        return 0, len(bodies) * most_each
    api = apis.GENERATING[path]
    if failed(got):  # vLLM failed the request, perhaps after the decode loaded its prompt
        return 0, len(bodies) * most_each
    if refused(got) or apis.answers_alone(body, api):
        return 0, 0
    usage = got.get("usage") if isinstance(got.get("usage"), dict) else None
    one_token = usage.get("completion_tokens") == 1 if usage and not several else None
    fewest = most = 0
    for b in bodies:
        may_end_at_prefill = api is apis.COMPLETIONS and first_token.eligible(b)
        # One token in all: the prefill's (or, rarely, the decode's first after a prefill
        # token it could not show); several prompts or no usage: either.
        fewest += 0 if may_end_at_prefill and one_token is not False else 1
        most += most_each
    return fewest, most


@dataclass
class Tally:
    """What a fleet's run found, from any number of threads."""

    say: Callable[[str], None]
    differences: list[dict[str, Any]] = field(default_factory=list)
    tickets: list[dict[str, Any]] = field(default_factory=list)
    fewest: int = 0
    most: int = 0
    sent: int = 0
    left: set[str] = field(default_factory=lambda: {LEFT})  # ids of requests whose client left
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, limit: int) -> bool:
        """One more request, if ``limit`` are not sent yet."""
        with self.lock:
            self.sent += 1
            return self.sent <= limit


@dataclass
class Fleet:
    name: str
    prefill: VllmServer
    decode: VllmServer
    proxy: Server
    seeded: bool
    grammar: bool


def one(fleet: Fleet, request: Request, tally: Tally) -> Any:
    """``request`` through the proxy and to vLLM alone: the proxy's answer, and what it
    found (a difference, a ticket shown) in ``tally``."""
    if request.disconnect:
        got, ids = leave_early(fleet.proxy.url, request)
        tickets: list[str] = []
        with tally.lock:
            tally.left.update(ids)
    else:
        got, tickets = answer(fleet.proxy.url, request, request.body)
    fewest, most = handoffs(request, got)
    with tally.lock:
        tally.fewest, tally.most = tally.fewest + fewest, tally.most + most
    if tickets:
        with tally.lock:
            tally.tickets.append({"path": request.path, "body": request.body, "tickets": tickets})
        tally.say(f"TICKET in the answer to {request.path} {request.shown()}\n  {tickets[0]}")
    if request.disconnect:
        return got
    want = alone(fleet.prefill, request)
    # vLLM alone may answer a request differently from one time to the next (a streamed
    # echo with logprobs and n > 1 drops a choice now and then: a KeyError in its API
    # server): the proxy's answer counts as right where vLLM itself gives it too.
    if failed(got) and failed(want):  # vLLM's own 500; the proxy names the leg (502)
        tally.say(f"vLLM fails {request.path} {request.shown()}: {str(want)[:200]}")
        return got
    for _ in range(3 if difference(got, want) else 0):
        if (again := alone(fleet.prefill, request)) == got:
            tally.say(f"vLLM itself answers {request.path} {request.shown()} either way")
            want = again
            break
    if (where := difference(got, want)) is not None:
        found = {"path": request.path, "body": request.body, "proxy": got, "vllm": want}
        with tally.lock:
            tally.differences.append(found)
        tally.say(f"DIFFERENT {request.path} {request.shown()}\n  {where}")
    return got


def converse(fleet: Fleet, seed: str, limit: int, tally: Tally) -> None:
    """One conversation (its own seeded draws): a request, then, as often as drawn, its
    next turn; while fewer than ``limit`` requests are sent."""
    rng = random.Random(seed)
    prompt = prompt_of(rng, fleet.prefill.url)
    request: Request | None = draw(rng, prompt, rng.choice(PATHS), fleet.seeded, fleet.grammar,
                                   fleet.decode.side_channel)  # fmt: skip
    while request is not None and tally.take(limit):
        got = one(fleet, request, tally)
        if tally.sent % 25 == 0:
            tally.say(f"{tally.sent} sent, {len(tally.differences)} different")
        request = follow_up(rng, request, got) if maybe(rng, 0.4) else None


def compare(fleet: Fleet, n: int, seed: int, concurrency: int, tally: Tally) -> None:
    """``n`` requests, ``concurrency`` conversations at once."""

    def conversations() -> Iterator[str]:
        i = 0
        while tally.sent < n:
            yield f"{seed}-{fleet.name}-{i}"
            i += 1

    if concurrency == 1:
        for s in conversations():
            converse(fleet, s, n, tally)
        return
    with ThreadPoolExecutor(concurrency) as pool:
        running: set[Any] = set()
        for s in conversations():
            while len(running) >= concurrency:  # no conversation drawn past the n-th request
                running = {f for f in running if not f.done()}
                time.sleep(0.05)
            running.add(pool.submit(converse, fleet, s, n, tally))
        for f in running:
            f.result()


def log_lines(server: VllmServer) -> list[str]:
    return server.log_path.read_text(errors="replace").splitlines()


def transfers(fleet: Fleet, before: dict[str, float], tally: Tally, reuse: bool) -> list[str]:
    """What the run's transfers did wrong: loads the requests do not explain, load
    failures, an engine still busy or holding staging pages or blocks."""
    time.sleep(1.5)  # the last step's connector stats reach /metrics
    decode, prefill = fleet.decode, fleet.prefill
    loaded = decode.metric(LOADED, 0.0) - before["loaded"]
    failed = decode.metric(LOAD_FAILURES, 0.0) - before["failed"]
    # Load failures of requests whose client left are not the transfer's (logged by id).
    log = log_lines(fleet.decode)[int(before["log_lines"]) :]
    failed -= sum(1 for line in log
                  if "KV load failed" in line and any(i in line for i in tally.left))  # fmt: skip
    problems = []
    if not tally.fewest <= loaded <= tally.most:
        problems.append(f"the decode loaded {loaded:.0f} prompts, expected {tally.fewest}"
                        f"..{tally.most}")  # fmt: skip
    if failed:
        problems.append(f"{failed:.0f} loads failed on the decode")

    def idle() -> bool:
        busy = decode.metric(RUNNING, 0.0) + decode.metric(WAITING, 0.0)
        held = prefill.metric(PAGES_IN_USE, 0.0)
        blocks = 0.0 if reuse else decode.metric(KV_USAGE, 0.0)  # kept turns hold blocks
        return busy == held == blocks == 0

    if not poll_until(idle, 30)[0]:
        problems.append(
            f"not idle 30 s after the last answer: the decode runs {decode.metric(RUNNING, 0.0)}"
            f" and queues {decode.metric(WAITING, 0.0)} requests, uses "
            f"{decode.metric(KV_USAGE, 0.0):.4f} of its KV cache; the prefill holds "
            f"{prefill.metric(PAGES_IN_USE, 0.0)} staging pages"
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=500, help="per fleet")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=1, help="conversations in flight")
    other = "another model (scripts/make_random_model.py), served in float32"
    p.add_argument("--model", type=Path, default=MODEL, help=other)
    spec = "the capped fleet's --speculative-config (JSON; none: off), vLLM alone's too"
    p.add_argument("--speculative-config", default=NGRAM, help=spec)
    p.add_argument("--fleet", choices=FLEETS, default=None, help="only this fleet")
    broken = "start each decode with another side-channel key than its prefill's: every load fails"
    p.add_argument("--break-transfers", action="store_true", help=broken)
    a = p.parse_args(argv)
    speculative = None if a.speculative_config == "none" else a.speculative_config
    found = run_differential(a.requests, a.seed, print, a.model, speculative, a.fleet,
                             a.concurrency, a.break_transfers)  # fmt: skip
    return 1 if found else 0


FLEETS = ("plain", "capped")


def key_file(run: LiveRun, name: str) -> str:
    """A fresh side-channel key in a 0600 file of ``run``."""
    path = run.dir / f"{name}.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return str(path)


def start_fleet(
    run: LiveRun, label: str, extra: list[str], model: Path, reuse: bool, broken: bool
) -> tuple[VllmServer, VllmServer]:
    """A prefill and a decode of ``model``, started with ``extra``; the decode fails a
    request whose load fails. ``reuse``: it keeps turns for the next turn's prefill
    (``reuse_turns``) and recomputes instead. ``broken``: the two hold different
    side-channel keys."""
    keys = [key_file(run, f"{label}-{i}") for i in range(2)] if broken else [None, None]
    roles = ("kv_producer", "kv_both" if reuse else "kv_consumer")
    # The prefill recomputes a kept turn it cannot load; a decode that keeps turns must
    # recompute too (the connector refuses reuse_turns with "fail"): there, the counters tell.
    policies = ("recompute", "recompute" if reuse else "fail")
    kv = [
        kv_config(role, run.engine_id(label + role[3]), free_port(), policy=policy,
                  reuse_turns=reuse, **({"side_channel_key_file": key} if key else {}))
        for role, policy, key in zip(roles, policies, keys, strict=True)
    ]  # fmt: skip
    prefill = run.vllm(f"{label}p", "0", kv[0], extra_args=extra, model=model)
    decode = run.vllm(f"{label}d", "1", kv[1], extra_args=extra, model=model)
    return prefill, decode


def run_differential(
    n: int, seed: int, say: Callable[[str], None], model: Path = MODEL,
    speculative: str | None = NGRAM, only: str | None = None, concurrency: int = 1,
    broken: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Both fleets (vLLM's defaults; a generation-config cap, ``speculative`` decoding),
    ``n`` requests each, ``concurrency`` at once; ``only``: that one of `FLEETS`. Returns
    the differences, tickets shown and transfer problems found."""
    chat = ["--chat-template", CHAT_TEMPLATE, "--trust-request-chat-template"]
    if model != MODEL:  # random weights: float32, as the harness serves them (no near-ties)
        chat += ["--dtype", "float32"]
    if concurrency > 1:  # no prompt split over steps (a seeded one's would kill vLLM: `draw`)
        chat += ["--max-num-batched-tokens", str(max(2048, 3 * concurrency * CONTEXT))]
    # The capped fleet also runs without prefix caching (n > 1 siblings then share no
    # block), and with a chat template that marks roles (the later one counts).
    cap = [*chat, "--override-generation-config", json.dumps({"max_new_tokens": CAP}),
           "--no-enable-prefix-caching", "--chat-template", ROLE_TEMPLATE]  # fmt: skip
    if speculative:
        cap += ["--speculative-config", speculative]
    found: list[dict[str, Any]] = []
    with LiveRun("differential") as run:
        starts = {
            "plain": lambda: start_fleet(run, "plain", chat, model, False, broken),
            "capped": lambda: start_fleet(run, "capped", cap, model, True, broken),
        }
        engines = {name: start() for name, start in starts.items() if only in (None, name)}
        wait_all_ready(*(s for f in engines.values() for s in f))
        for name, (prefill, decode) in engines.items():
            options = ("--reuse-turns",) if name == "capped" else ()
            proxy = run.proxy([prefill.url], [decode.url], [decode.side_channel], options=options)
            wait_all_ready(proxy)
            seeded = name == "plain" or not speculative
            fleet = Fleet(name, prefill, decode, proxy, seeded, grammar=model != MODEL)
            say(f"[differential] fleet {name}: {n} requests, seed {seed}, concurrency "
                f"{concurrency}")  # fmt: skip
            before = {"loaded": decode.metric(LOADED, 0.0),
                      "failed": decode.metric(LOAD_FAILURES, 0.0),
                      "log_lines": len(log_lines(decode))}  # fmt: skip
            tally = Tally(say)
            t0 = time.monotonic()
            compare(fleet, n, seed, concurrency, tally)
            problems = transfers(fleet, before, tally, reuse=name == "capped")
            loaded = decode.metric(LOADED, 0.0) - before["loaded"]
            say(
                f"[differential] fleet {name}: {n} compared in {time.monotonic() - t0:.0f} s, "
                f"{len(tally.differences)} different, {len(tally.tickets)} answers with "
                f"tickets; {loaded:.0f} loaded (expected {tally.fewest}..{tally.most})"
            )
            for problem in problems:
                say(f"[differential] fleet {name}: TRANSFERS: {problem}")
            if name == "capped":  # the next turns' loads of the turns the decode kept
                kept, turns = decode.metric(KEPT, 0.0), prefill.metric(LOADED, 0.0)
                say(f"[differential] fleet {name}: {kept:.0f} turns kept, {turns:.0f} loaded")
            found += tally.differences + tally.tickets
            found += [{"fleet": name, "transfers": p} for p in problems]
        run.keep |= bool(found)  # the engines' logs say why (a crash: its stack)
    return found


if __name__ == "__main__":
    sys.exit(main())
