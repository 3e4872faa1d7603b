"""A ``/v1/completions`` request with a list of prompts, handed off one prompt at a time.

vLLM runs each prompt of a list as its own request, but answers with one
``kv_transfer_params``: the first prompt's. A decode given the whole list with that ticket
would load one prompt and fail the others' checks. So the proxy sends each prompt through
its own prefill and decode legs and puts the answers back together as vLLM would have
answered the list: each prompt's n choices, prompt by prompt, and usage summed over them.
Streamed, the prompts' events go into one stream as they come (`StreamedList`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from vllm_qaic_proxy.first_token import STREAM_HEAD, event

USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def prompts(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a request that holds several (texts or token-id lists), else None."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    return prompt if all(isinstance(p, (str, list)) for p in prompt) else None


def merged(answers: list[tuple[int, dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
    """One answer for the list, from each prompt's (status, body) in prompt order; the
    first failure is the list's answer, as vLLM fails a list on any prompt's error."""
    for status, answer in answers:
        if status != 200:
            return status, answer
    ordered = (
        choice
        for _, answer in answers
        for choice in sorted(answer.get("choices") or (), key=lambda c: c.get("index", 0))
    )  # prompt by prompt, each prompt's n choices in order
    choices = [{**choice, "index": i} for i, choice in enumerate(ordered)]
    first = answers[0][1]
    usage = first.get("usage")
    if isinstance(usage, dict):
        usage = summed([a.get("usage") or {} for _, a in answers])
    return 200, {**first, "choices": choices, "usage": usage}


def summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The prompts' usage as one: the counts summed, the rest (details) as the first's."""
    usage = dict(usages[0])
    for name in USAGE_COUNTS:
        counts = [u.get(name) for u in usages]
        if all(isinstance(n, int) for n in counts):
            usage[name] = sum(counts)
    return usage


class StreamedList:
    """A streamed list of prompts: each prompt's handoff streams into one client stream, as
    vLLM streams a list. Prompt p's choice i is ``p * n + i``, every event carries the first
    prompt's id, and one usage event (the counts summed) and one ``[DONE]`` end it. The
    client's stream opens with the first prompt's events; a prompt that fails before any
    opened it leaves the list's answer to `merged`'s rule."""

    def __init__(self, request: web.Request, n: Any) -> None:
        self._request, self._n = request, n if isinstance(n, int) else 1  # the request's n
        self.out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        self._opened = asyncio.Lock()
        self._head: dict[str, Any] = {}  # the first event's id, object, created, model
        self.usages: list[dict[str, Any]] = []

    def part(self, prompt: int) -> Part:
        return Part(self, prompt * self._n)

    async def open(self) -> None:
        async with self._opened:
            if not self.out.prepared:
                await self.out.prepare(self._request)

    async def send(self, payload: dict[str, Any], offset: int) -> None:
        choices = payload.get("choices")
        if not choices and isinstance(payload.get("usage"), dict):
            self.usages.append(payload["usage"])  # a prompt's total: summed at the end
            return
        if isinstance(choices, list):
            payload["choices"] = [
                {**c, "index": c.get("index", 0) + offset} if isinstance(c, dict) else c
                for c in choices
            ]
        self._head = self._head or {k: payload[k] for k in STREAM_HEAD if k in payload}
        if "id" in payload:
            payload["id"] = self._head.get("id", payload["id"])
        await self.out.write(event(payload))

    async def finish(self, failures: list[tuple[int, dict[str, Any]]]) -> web.StreamResponse:
        """The end of the list's stream: each failed prompt's error as an event (vLLM ends a
        stream that failed so), the summed usage where asked, ``[DONE]``."""
        with contextlib.suppress(ConnectionResetError):  # the client went away: nothing to end
            await self.open()
            for _, error in failures:
                await self.out.write(event(error))
            if self.usages:
                end = {**self._head, "choices": [], "usage": summed(self.usages)}
                await self.out.write(event(end))
            await self.out.write(b"data: [DONE]\n\n")
            await self.out.write_eof()
        return self.out


class Part:
    """One prompt's stream, written as a client stream is (`prepare`, `write`, `write_eof`),
    re-indexed into the list's (whole events only: each write may end mid-line)."""

    def __init__(self, stream: StreamedList, offset: int) -> None:
        self._stream, self._offset, self._pending = stream, offset, b""
        self.response = stream.out  # the client's, which the whole list streams into

    async def prepare(self, request: web.Request) -> None:
        await self._stream.open()

    async def write(self, data: bytes) -> None:
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if line.startswith(b"data: {"):
                await self._stream.send(json.loads(line[6:]), self._offset)

    async def write_eof(self) -> None:
        await self.write(b"\n")
