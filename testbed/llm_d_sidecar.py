"""llm-d's routing sidecar (`-connector=nixlv2`) as a client: the request sequence it sends
a P/D pair, for servers llm-d would front. The sidecar itself is Go and not installable
here; tests/live/test_faults.py's test_k drives a vLLM pair with it."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

# What vLLM's router, llm-d's sidecar and Dynamo send a prefill: NixlConnector's fields,
# no decode named.
ROUTER_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


async def sidecar_completion(
    session: aiohttp.ClientSession, prefill: str, decode: str, body: dict[str, Any], rid: str
) -> tuple[int, dict[str, Any]]:
    """One completion as the sidecar makes it: the prefill leg is ``body`` with
    NixlConnector's params, not streamed, ``stream_options`` dropped and ``max_tokens`` 1;
    the decode leg is ``body`` streamed (with usage) and the prefill's
    ``kv_transfer_params`` copied whole; one ``x-request-id`` on both. Returns the status
    and the answer as one non-streamed body (text and token ids joined from the chunks)."""
    headers = {"x-request-id": rid}
    leg = {k: v for k, v in body.items() if k != "stream_options"}
    leg.update(stream=False, max_tokens=1, kv_transfer_params=ROUTER_PARAMS)
    async with session.post(f"{prefill}/v1/completions", json=leg, headers=headers) as resp:
        first = await resp.json(content_type=None)
        if resp.status != 200:
            return resp.status, first
    leg = {**body, "stream": True, "stream_options": {"include_usage": True},
           "kv_transfer_params": first.get("kv_transfer_params")}  # fmt: skip
    async with session.post(f"{decode}/v1/completions", json=leg, headers=headers) as resp:
        if resp.status != 200:
            return resp.status, await resp.json(content_type=None)
        events = [line async for line in resp.content]
    chunks = [json.loads(line[6:]) for line in events if line.startswith(b"data: {")]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    text = "".join(c["text"] for c in choices)
    ids = [t for c in choices for t in c.get("token_ids") or []]
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    return 200, {"choices": [{"text": text, "token_ids": ids or None}], "usage": usage}
