"""The disaggregation proxy without vLLM: its routing and prefill request on their own, then the
real proxy app in front of small aiohttp stand-ins for the prefill and decode engines, with a
real side-channel server recording the early releases the proxy sends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from testbed.ports import free_port
from vllm_qaic_connector.protocol.side_channel import SideChannelServer
from vllm_qaic_connector.protocol.ticket import RemotePrefill
from vllm_qaic_connector.protocol.wire import (
    ErrorReply,
    Message,
    Ok,
    ReleaseRequest,
    TurnReply,
    TurnRequest,
)
from vllm_qaic_proxy import apis, first_token, legs, prompt_lists, routing
from vllm_qaic_proxy.apis import Api
from vllm_qaic_proxy.routing import LeastOutstanding, Router
from vllm_qaic_proxy.server import HANDLER_CANCELLATION, Proxy

PROMPT_IDS, FIRST_ID = [5, 6, 7], 8  # the stand-in prefill's prompt and first token
CHUNKS = [
    b'data: {"choices":[{"index":0,"text":"Hel"}]}\n\n',
    b'data: {"choices":[{"index":0,"text":"lo"}]}\n\n',
    b'data: {"choices":[{"index":0,"text":"!"}]}\n\n',
    b"data: [DONE]\n\n",
]
WAIT_S = 5.0  # the longest any stand-in or poll waits for something that should happen at once

pytestmark = pytest.mark.anyio  # the async tests, on anyio_backend's loop


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio only


# --- routing --------------------------------------------------------------------------------


def test_least_outstanding_picks_the_least_busy_and_rotates_ties() -> None:
    pool = LeastOutstanding(["a", "b", "c"])
    assert sorted(pool.pick() for _ in range(3)) == ["a", "b", "c"]  # an idle pool rotates
    with pool.busy("a"), pool.busy("a"), pool.busy("b"):
        assert pool.pick() == "c"
        with pool.busy("c"):
            assert pool.pick() == "b"
    assert pool.outstanding == {"a": 0, "b": 0, "c": 0}


def test_a_busy_backend_gets_nothing_while_another_is_idle() -> None:
    pool = LeastOutstanding(["slow", "idle"])
    with pool.busy("slow"):  # one slow request in flight
        picks = []
        for _ in range(5):
            backend = pool.pick()
            picks.append(backend)
            with pool.busy(backend):  # each of these ends before the next arrives
                pass
    assert picks == ["idle"] * 5


def test_a_pool_of_no_backends_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="no backends"):
        LeastOutstanding([])


def test_pairs_cycle_through_every_prefill_decode_pair() -> None:
    router = Router(["p1", "p2"], ["d1", "d2", "d3"], "pairs")
    first = [router.route() for _ in range(6)]
    assert sorted(first) == [(p, d) for p in ("p1", "p2") for d in ("d1", "d2", "d3")]
    assert [router.route() for _ in range(6)] == first


def test_a_bad_routing_mode_names_the_choices() -> None:
    with pytest.raises(ValueError, match="least-outstanding, pairs"):
        Router(["p"], ["d"], "random")


# --- the prefill leg's request --------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("limit", ["max_tokens", "max_completion_tokens"])
def test_the_prefill_leg_asks_for_one_token_and_never_streams(chat: bool, limit: str) -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        limit: 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": 3,
        "echo": True,
        "some_new_field": {"x": 1},
    }
    out = (apis.CHAT if chat else apis.COMPLETIONS).prefill_body(body, "10.0.0.2:5557")
    limits = {k: out[k] for k in ("max_tokens", "max_completion_tokens") if k in out}
    assert limits and set(limits.values()) == {1}, limits
    if chat or limit == "max_completion_tokens":
        assert out["max_completion_tokens"] == 1  # the limit the server reads first
    assert out["stream"] is False
    assert not {"stream_options", "logprobs", "echo"} & out.keys()
    assert out["some_new_field"] == {"x": 1} and out["model"] == "m"
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "decode_host": "10.0.0.2",
        "decode_port": 5557,
    }
    assert body[limit] == 50 and body["stream"] is True  # the client's body is untouched


# One value of each option a client may send, with what vLLM requires beside it.
OPTIONS: list[dict[str, Any]] = [
    {"logprobs": 2}, {"logprobs": 2, "logprob_token_ids": [5, 6]}, {"echo": True},
    {"prompt_logprobs": 1}, {"stop": ["]"]}, {"bad_words": ["x"]}, {"min_tokens": 3},
    {"frequency_penalty": 0.5}, {"repetition_detection": {"max_pattern_size": 2, "min_count": 3}},
    {"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a+"}},
    {"n": 2, "temperature": 0.9}, {"seed": 3}, {"stream": True, "stream_options":
    {"include_usage": True, "continuous_usage_stats": True}}, {"return_token_ids": True},
    {"max_tokens": 1}, {"min_tokens": 1, "max_tokens": 1}, {"truncate_prompt_tokens": 3},
    {"use_beam_search": True}, {"stop_token_ids": [5], "include_stop_str_in_output": True},
]  # fmt: skip


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: ",".join(o))
def test_the_prefill_leg_of_a_request_vllm_accepts_is_one_vllm_accepts(
    chat: bool, option: dict[str, Any]
) -> None:
    """The prefill leg drops and sets fields; one that another needs must not go alone.
    It did: ``logprob_token_ids`` went without ``logprobs``, and vLLM refused the leg."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    schema = ChatCompletionRequest if chat else CompletionRequest
    prompt = {"messages": [{"role": "user", "content": "a b"}]} if chat else {"prompt": "a b"}
    body = {"model": "m", "max_tokens": 5, **prompt, **option}
    if chat and "logprobs" in option:  # chat's logprobs: a flag and a count
        body.update(logprobs=True, top_logprobs=option["logprobs"])
    schema.model_validate(body)
    schema.model_validate((apis.CHAT if chat else apis.COMPLETIONS).prefill_body(body, "h:1"))


def schema_of(api: Api) -> Any:
    """vLLM's request model for ``api``."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return {
        apis.COMPLETIONS: CompletionRequest, apis.CHAT: ChatCompletionRequest,
        apis.RESPONSES: ResponsesRequest, apis.MESSAGES: AnthropicMessagesRequest,
    }[api]  # fmt: skip


# A request of each API as a client sends it, streamed, with its own output limit.
REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "a b", "max_tokens": 50},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 50},
    "/v1/responses": {"input": "a b", "max_output_tokens": 50, "instructions": "be brief"},
    "/v1/messages": {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 50,
                     "system": "be brief", "stop_sequences": ["."]},
}  # fmt: skip


@pytest.mark.parametrize("path", list(REQUESTS))
def test_every_api_s_prefill_leg_is_one_token_that_vllm_accepts(path: str) -> None:
    """vLLM takes kv_transfer_params on each of these; the leg must be valid for vLLM's own
    request model and ask it for one token, not streamed, storing nothing."""
    api = apis.GENERATING[path]
    body = {"model": "m", "stream": True, **REQUESTS[path]}
    leg = api.prefill_body(body, "10.0.0.2:5557")
    request = schema_of(api).model_validate(leg)
    limit = {apis.RESPONSES: "max_output_tokens", apis.CHAT: "max_completion_tokens"}
    assert getattr(request, limit.get(api, "max_tokens")) == 1 and request.stream is False
    assert request.kv_transfer_params == {
        "do_remote_decode": True, "decode_host": "10.0.0.2", "decode_port": 5557,
    }  # fmt: skip
    if api is apis.RESPONSES:  # nobody fetches the leg's answer, and its ticket is needed now
        assert request.store is False and request.background is False
    assert body["stream"] is True and "kv_transfer_params" not in body  # the client's, as sent


def test_the_prefill_leg_names_no_decode_without_decode_kv() -> None:
    out = apis.COMPLETIONS.prefill_body({"prompt": "hi"}, "")
    assert out["kv_transfer_params"] == {"do_remote_decode": True}


def test_a_list_of_prompts_is_answered_as_vllm_answers_it() -> None:
    assert prompt_lists.prompts({"prompt": "hi"}) is None
    assert prompt_lists.prompts({"prompt": [5, 6, 7]}) is None  # token ids: one prompt
    assert prompt_lists.prompts({"prompt": ["a", [5, 6]]}) == ["a", [5, 6]]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "details": None}
    answer = {"id": "x", "choices": [{"index": 0, "text": "t"}], "usage": usage}
    status, merged = prompt_lists.merged([(200, answer), (200, answer)])
    assert status == 200 and [c["index"] for c in merged["choices"]] == [0, 1]
    assert merged["usage"] == {**usage, "prompt_tokens": 6, "completion_tokens": 4,
                               "total_tokens": 10}  # fmt: skip
    two = {**answer, "choices": [{"index": 1, "text": "b"}, {"index": 0, "text": "a"}]}
    _, merged = prompt_lists.merged([(200, two), (200, two)])  # n = 2: prompt i's j is 2i + j
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a"), (1, "b"), (2, "a"), (3, "b")]  # fmt: skip
    failed = {"error": {"message": "boom"}}
    assert prompt_lists.merged([(200, answer), (503, failed), (502, {})]) == (503, failed)


# --- stand-in engines -----------------------------------------------------------------------


def staged(request_id: str, side_port: int) -> dict[str, Any]:
    """The kv_transfer_params a prefill returns: its staging, released over its side channel."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": side_port,
        "remote_request_id": request_id,
        "num_tokens": 4,
        "staging_offset": 0,
        "staged_layout": "vllm_cpu_vec",
        "staged_block_size": 128,
        "incarnation": "feedfacefeedface",
        "generation": 1 << 32,
        "prompt_hash": "0123456789abcdef" * 2,
        "lease_s": 60.0,
        "expires_at": time.time() + 60.0,
    }


async def serve(app: web.Application, **settings: Any) -> tuple[web.AppRunner, str]:
    """``app`` on a real port with web.run_app's settings and ``settings``; its runner and
    base URL."""
    runner = web.AppRunner(app, shutdown_timeout=1.0, **settings)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


class Backend(ABC):
    """A small aiohttp server on a real port; records what each completion request sent."""

    model = "backend"

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (path, body)
        self.stored: set[str] = set()  # the Responses API's stored answers it holds
        self.request_ids: list[str | None] = []  # each completion request's X-Request-Id
        self.extra: list[bytes] = []  # events its streams send before their last
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 30)  # as vLLM: any size
        for path in apis.GENERATING:
            app.router.add_post(path, self._complete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions/render", self._tokenize)  # as it answers: ids
        app.router.add_get("/v1/responses/{id}", self._stored)
        app.router.add_post("/inference/v1/generate", self._generate)
        self._runner, self.url = await serve(app)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body))
        self.request_ids.append(request.headers.get("X-Request-Id"))
        return await self.complete(request, body)

    @abstractmethod
    async def complete(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """This backend's answer to a completion request."""

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((request.path, body))
        key = request.headers.get("Authorization")
        return web.json_response({"tokens": PROMPT_IDS, "by": self.model, "key": key})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        """vLLM's token-in, token-out route, which takes and returns kv_transfer_params."""
        body = await request.json()
        self.requests.append((request.path, body))
        answer = {"request_id": "g", "choices": [{"token_ids": [FIRST_ID]}]}
        answer["kv_transfer_params"] = staged("g", 1)
        if not body.get("stream"):
            return web.json_response(answer)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(f"data: {json.dumps(answer)}\n\n".encode() + CHUNKS[-1])
        return out

    async def _stored(self, request: web.Request) -> web.Response:
        """A stored response: only its id's holder has it (vLLM's store is per server)."""
        if request.match_info["id"] not in self.stored:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return web.json_response({"id": request.match_info["id"], "by": self.model})


class Prefill(Backend):
    """Answers with staged kv_transfer_params, after ``delay_s``; ``answer`` "kv-error" or
    "reject" instead says the handoff failed, or refuses the request with HTTP 400; "crash"
    answers HTTP 500."""

    model = "prefill-model"
    REJECTION = {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}

    def __init__(self, side_port: int) -> None:
        super().__init__()
        self.side_port = side_port
        self.answer = "staged"
        self.delay_s = 0.0
        self.finish_reason = "length"
        self.token_ids = False  # whether it answers return_token_ids (older vLLM does not)
        self.staged_tokens = len(PROMPT_IDS)  # one short: a model with Mamba layers
        self.params: list[dict[str, Any]] = []  # the kv_transfer_params returned

    async def complete(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(self.delay_s)
        if self.answer == "reject":
            return web.json_response(self.REJECTION, status=400)
        if self.answer == "crash":
            error = {"error": {"message": "EngineCore died", "code": 500}}
            return web.json_response(error, status=500)
        if body.get("stream"):  # a whole request, as when no decode could take it
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for chunk in [*CHUNKS[:-1], *self.extra, CHUNKS[-1]]:
                await out.write(chunk)
            return out
        if self.answer == "kv-error":
            params: dict[str, Any] = {"error": "staging is full"}
        else:
            params = {**staged(f"pf-{len(self.requests)}", self.side_port)}
            params["num_tokens"] = self.staged_tokens
        self.params.append(params)
        choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": self.finish_reason}
        if self.token_ids and body.get("return_token_ids"):
            choice.update(prompt_token_ids=PROMPT_IDS, token_ids=[FIRST_ID])
        usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 1, "total_tokens": 4}
        answer = {"id": "cmpl-p", "object": "text_completion", "choices": [choice]}
        return web.json_response({**answer, "usage": usage, "kv_transfer_params": params})


class Decode(Backend):
    """Answers JSON, or (``answer`` "text") an HTTP 200 text/plain page. Streams CHUNKS: after
    the first it waits for ``go`` (at most WAIT_S), or with ``answer`` "endless" it sends
    events until its connection closes, which it reports as ``aborted``."""

    model = "decode-model"

    def __init__(self, name: str = "decode") -> None:
        super().__init__()
        self.name = name
        self.answer = "json"
        self.log: list[str] = []  # the stream's milestones, shared with the test's client
        self.go = asyncio.Event()
        self.aborted = asyncio.Event()

    def answer_for(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "text": f"{self.name} says hi", "finish_reason": "length"}
        usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
        return {"id": self.name, "object": "text_completion", "choices": [choice], "usage": usage}

    async def complete(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if body.get("previous_response_id") not in (None, *self.stored):
            return web.json_response({"error": {"message": "not found"}}, status=404)
        if self.answer == "text":
            return web.Response(text="upstream exploded", content_type="text/plain")
        if self.answer == "reject":  # what vLLM refuses before it streams
            return web.json_response(Prefill.REJECTION, status=400)
        if not body.get("stream"):
            return web.json_response(self.answer_for(body))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if self.answer == "endless":
            try:
                for _ in range(int(WAIT_S / 0.02)):
                    await out.write(CHUNKS[0])
                    await asyncio.sleep(0.02)
            except ConnectionResetError:
                self.aborted.set()
            return out
        self.log.append("decode sends first")
        await out.write(CHUNKS[0])
        try:
            await asyncio.wait_for(self.go.wait(), WAIT_S)
        except asyncio.TimeoutError:
            self.log.append("decode gave up waiting")
        for chunk in [*CHUNKS[1:-1], *self.extra]:
            await asyncio.sleep(0.02)
            await out.write(chunk)
        if self.answer == "usage":  # a server with --enable-force-include-usage, unasked
            usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
            await out.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await asyncio.sleep(0.02)
        self.log.append("decode sends last")
        await out.write(CHUNKS[-1])
        await out.write_eof()
        return out


class SideChannel:
    """A real side-channel server, as a prefill runs it: records the releases it is sent;
    as a decode that keeps turns runs it, gives the ``turns`` it kept by name."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.turns: dict[str, RemotePrefill] = {}
        self.server = SideChannelServer("127.0.0.1", free_port(), self._handle, None)

    def _handle(self, msg: Message) -> Message:
        if isinstance(msg, ReleaseRequest):
            self.released.extend(msg.request_ids)
        if isinstance(msg, TurnRequest):
            kept = self.turns.get(msg.turn_id)
            return TurnReply(kept) if kept else ErrorReply(f"no turn kept as {msg.turn_id}")
        return Ok()

    async def wait_released(self, request_id: str) -> list[str]:
        deadline = time.monotonic() + WAIT_S
        while request_id not in self.released and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.released


@pytest.fixture
def side() -> Iterator[SideChannel]:
    channel = SideChannel()
    yield channel
    channel.server.close()


@pytest.fixture
async def prefill(side: SideChannel) -> AsyncIterator[Prefill]:
    backend = Prefill(side.server.port)
    await backend.start()
    yield backend
    await backend.stop()


@pytest.fixture
async def decode() -> AsyncIterator[Decode]:
    backend = Decode()
    await backend.start()
    yield backend
    await backend.stop()


@asynccontextmanager
async def proxy(
    prefills: list[str], decodes: list[str], **kw: Any
) -> AsyncIterator[aiohttp.ClientSession]:
    """The real proxy app on a real port, served as vllm-qaic-proxy serves it, and a client."""
    async with served(Proxy(prefills, decodes, **kw)) as client:
        yield client


@asynccontextmanager
async def served(made: Proxy) -> AsyncIterator[aiohttp.ClientSession]:
    """``made``'s app on a real port, as vllm-qaic-proxy serves it, and a client."""
    runner, url = await serve(made.app(), handler_cancellation=HANDLER_CANCELLATION)
    try:
        async with aiohttp.ClientSession(base_url=url) as client:
            yield client
    finally:
        await runner.cleanup()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


async def error_of(resp: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    body: dict[str, Any] = (await resp.json())["error"]
    return body


PROMPT = {"model": "m", "prompt": "hi", "max_tokens": 5}


# --- end to end -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(apis.GENERATING))
async def test_the_decode_gets_the_prefills_params_and_the_client_its_answer(
    prefill: Prefill, decode: Decode, path: str
) -> None:
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post(path, json={**PROMPT, "temperature": 0})
        assert resp.status == 200, await resp.text()
        assert await resp.json() == decode.answer_for(PROMPT)
    [(prefill_path, to_prefill)] = prefill.requests
    [(decode_path, to_decode)] = decode.requests
    assert prefill_path == decode_path == path
    limit = apis.GENERATING[path].limits[0]
    assert to_prefill[limit] == 1 and to_prefill["kv_transfer_params"]["do_remote_decode"]
    assert to_decode == {**PROMPT, "temperature": 0, "kv_transfer_params": prefill.params[0]}


async def test_a_long_context_prompt_is_not_refused_for_its_size(
    prefill: Prefill, decode: Decode
) -> None:
    """200k token ids, ~1.4 MB of JSON: vLLM's server takes it; the proxy refused anything
    over aiohttp's default 1 MiB with a bare 413."""
    body = {"prompt": list(range(100_000, 300_000)), "max_tokens": 5}
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
    assert decode.requests[0][1]["prompt"] == body["prompt"]


async def test_more_streams_than_aiohttp_s_connection_cap_all_reach_the_decode(
    prefill: Prefill, decode: Decode
) -> None:
    """A stream holds its decode connection to its end. With aiohttp's default cap (100
    connections), request 101 waited for one to end: p90 time to first token 5.6 s, against
    0.7 s without it (120 streams of 300 tokens, live)."""
    decode.answer, streams = "endless", 110
    body = {**PROMPT, "stream": True}
    async with (
        proxy([prefill.url], [decode.url]) as client,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as clients,
    ):
        url = f"{client._base_url}/v1/completions"
        pending = [asyncio.ensure_future(clients.post(url, json=body)) for _ in range(streams)]
        deadline = time.monotonic() + WAIT_S / 2
        while len(decode.requests) < streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        reached = len(decode.requests)
        for resp in await asyncio.gather(*pending):
            resp.close()
    assert reached == streams


async def test_a_stream_comes_through_as_it_is_sent(prefill: Prefill, decode: Decode) -> None:
    received = b""
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        async for piece in resp.content.iter_any():
            if not received:
                decode.log.append("client got first")
                decode.go.set()
            received += piece
    assert decode.log == ["decode sends first", "client got first", "decode sends last"]
    assert received == b"".join(CHUNKS)
    assert decode.requests[0][1]["stream"] is True
    assert prefill.requests[0][1]["stream"] is False


@pytest.mark.parametrize("stream", [False, True])
async def test_the_prefill_legs_time_is_in_server_timing(
    prefill: Prefill, decode: Decode, stream: bool
) -> None:
    prefill.delay_s = 0.3
    decode.go.set()
    async with proxy([prefill.url], [decode.url]) as client:
        t0 = time.monotonic()
        resp = await client.post("/v1/completions", json={**PROMPT, "stream": stream})
        await resp.read()
        elapsed_ms = (time.monotonic() - t0) * 1e3
    name, _, dur = resp.headers["Server-Timing"].partition(";dur=")
    assert name == "prefill" and 300 <= float(dur) <= elapsed_ms


async def test_a_busy_decode_gets_no_requests_while_another_is_idle(
    prefill: Prefill, decode: Decode
) -> None:
    idle = Decode("idle")
    await idle.start()
    try:
        async with proxy([prefill.url], [decode.url, idle.url]) as client:
            slow = await client.post("/v1/completions", json={**PROMPT, "stream": True})
            await slow.content.readany()  # the stream is under way on the first decode
            for _ in range(3):
                resp = await client.post("/v1/completions", json=PROMPT)
                assert (await resp.json())["id"] == "idle"
            decode.go.set()
            await slow.read()
    finally:
        await idle.stop()
    assert len(decode.requests) == 1 and len(idle.requests) == 3


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_no_decode_to_serve_it_leaves_the_request_to_a_prefill_and_releases_the_staging(
    prefill: Prefill, side: SideChannel, stream: bool
) -> None:
    """Every decode down: a prefill answers the request whole (the prompt is in its prefix
    cache by then), and the KV it staged is released. Before, HTTP 503."""
    body = {**PROMPT, "stream": stream}
    async with proxy([prefill.url], [dead_url()]) as client:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        await resp.read()
    [(_, leg), (_, whole)] = prefill.requests
    assert leg["kv_transfer_params"]["do_remote_decode"] and whole == body
    assert await side.wait_released("pf-1") == ["pf-1"]


async def test_no_backend_at_all_is_503(decode: Decode) -> None:
    async with proxy([dead_url()], [dead_url()]) as client:
        error = await error_of(await client.post("/v1/completions", json=PROMPT), 503)
    assert "unreachable" in error["message"]


async def test_a_silent_decode_leg_is_504_and_releases_the_staging(
    prefill: Prefill, side: SideChannel
) -> None:
    with socket.socket() as silent:  # listens (the kernel completes connections), never answers
        port = free_port()
        silent.bind(("127.0.0.1", port))
        silent.listen(8)
        async with proxy([prefill.url], [f"http://127.0.0.1:{port}"], decode_timeout_s=1) as client:
            error = await error_of(await client.post("/v1/completions", json=PROMPT), 504)
    assert "decode leg" in error["message"] and "timed out" in error["message"]
    assert await side.wait_released("pf-1") == ["pf-1"]


async def test_a_decode_answering_non_json_is_502_and_releases_the_staging(
    prefill: Prefill, decode: Decode, side: SideChannel
) -> None:
    decode.answer = "text"
    async with proxy([prefill.url], [decode.url]) as client:
        error = await error_of(await client.post("/v1/completions", json=PROMPT), 502)
    assert "decode leg" in error["message"] and "upstream exploded" in error["message"]
    assert await side.wait_released("pf-1") == ["pf-1"]


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_no_prefill_to_serve_it_leaves_the_prompt_to_the_decode(
    decode: Decode, stream: bool
) -> None:
    """Every prefill down (a pool restarting, or dead): the decode computes the prompt and
    answers, slower, as llm-d's sidecar falls back. Before, every request got 503 while
    the decodes that could answer it stood idle."""
    decode.go.set()  # its streams end at once
    async with proxy([dead_url(), dead_url()], [decode.url]) as client:
        resp = await client.post("/v1/completions", json={**PROMPT, "stream": stream})
        assert resp.status == 200, await resp.text()
        await resp.read()
    assert decode.requests == [("/v1/completions", {**PROMPT, "stream": stream})]


async def test_a_failing_prefill_leaves_the_prompt_to_the_decode(
    prefill: Prefill, decode: Decode
) -> None:
    prefill.answer = "crash"  # HTTP 500, as an engine whose core died answers
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json=PROMPT)
        assert resp.status == 200 and await resp.json() == decode.answer_for(PROMPT)
    assert decode.requests == [("/v1/completions", PROMPT)]


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_a_dead_backend_costs_a_retry_on_another_not_an_error(
    prefill: Prefill, decode: Decode, stream: bool
) -> None:
    """One dead prefill and one dead decode beside live ones (ports nothing listens on, as
    after a SIGKILL): every request is answered, and after its first refusal a dead backend
    is skipped, so it is tried once per leg, not once per request."""
    dead_prefill, dead_decode = dead_url(), dead_url()
    decode.go.set()  # its streams end at once
    async with proxy([dead_prefill, prefill.url], [dead_decode, decode.url]) as client:
        for _ in range(4):
            resp = await client.post("/v1/completions", json={**PROMPT, "stream": stream})
            assert resp.status == 200, await resp.text()
            await resp.read()
    assert len(prefill.requests) == 4 and len(decode.requests) == 4


def test_a_backend_marked_down_is_skipped_until_its_time_is_up(monkeypatch) -> None:
    pool = LeastOutstanding(["a", "b"])
    pool.mark_down("a")
    assert {pool.pick() for _ in range(4)} == {"b"} and pool.failover("b") == ["b"]
    assert pool.failover("a") == ["a", "b"]  # asked for it: tried first, then the others
    pool.mark_down("b")
    assert pool.pick() in {"a", "b"}  # all down: each is tried all the same
    now = time.monotonic()
    monkeypatch.setattr(routing.time, "monotonic", lambda: now + routing.DOWN_S + 1)
    assert {pool.pick() for _ in range(4)} == {"a", "b"}


async def test_a_backend_400_passes_through(prefill: Prefill, decode: Decode) -> None:
    """The prefill's refusal is of its leg (one token, n = 1): the decode answers the
    request itself, and its refusal reaches the client as it came."""
    prefill.answer = decode.answer = "reject"
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json=PROMPT)
        assert resp.status == 400
        assert await resp.json() == Prefill.REJECTION
    assert len(decode.requests) == 1


async def test_a_failed_handoff_goes_to_the_decode_whose_policy_decides(
    prefill: Prefill, decode: Decode
) -> None:
    """As behind any router: the prefill's error reaches the decode, whose
    kv_load_failure_policy recomputes or fails. Before, the proxy answered 503."""
    prefill.answer, prefill.token_ids = "kv-error", True
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json=PROMPT)
        assert resp.status == 200 and await resp.json() == decode.answer_for(PROMPT)
    assert decode.requests[0][1] == {**PROMPT, "kv_transfer_params": {"error": "staging is full"}}


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (b'["hi"]', "JSON object"),
        (b"hi", "JSON object"),
    ],
    ids=["array", "not-json"],
)
async def test_bad_requests_are_400_before_any_leg(
    prefill: Prefill, decode: Decode, data: bytes, names: str
) -> None:
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", data=data)
        assert names in (await error_of(resp, 400))["message"]
    assert prefill.requests == [] and decode.requests == []


async def test_health_lists_each_backend(prefill: Prefill, decode: Decode) -> None:
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.get("/health")
        assert resp.status == 200
        assert await resp.json() == {
            "ok": True,
            "degraded": False,
            "prefill": {prefill.url: "ok"},
            "decode": {decode.url: "ok"},
        }
    dead = dead_url()
    async with proxy([prefill.url], [dead]) as client:
        resp = await client.get("/health")
        assert resp.status == 503
        report = await resp.json()
    assert report["ok"] is False and report["prefill"] == {prefill.url: "ok"}
    assert report["decode"][dead].startswith("unreachable")
    async with proxy([dead], [decode.url]) as client:  # it serves: the decodes compute
        resp = await client.get("/health")
        assert resp.status == 200 and (await resp.json())["degraded"] is True


async def test_models_come_from_a_decode(prefill: Prefill, decode: Decode) -> None:
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.get("/v1/models")
        assert resp.status == 200
        assert await resp.json() == {"object": "list", "data": [{"id": "decode-model"}]}


async def test_both_legs_carry_the_client_s_request_id(prefill: Prefill, decode: Decode) -> None:
    """vLLM takes X-Request-Id as the request's id: with it on both legs, the prefill's and
    the decode's logs name the client's id. Before, neither leg had it. Each request's gets
    a suffix of its own, so a client's repeated id never reaches an engine twice (an
    engine without vLLM's randomization asserts on a duplicate id)."""
    prefill.token_ids = True  # the decode continues from the prefill's token
    async with proxy([prefill.url], [decode.url]) as client:
        for stream in (False, True):
            body = {**PROMPT, "stream": stream}
            resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "r7"})
            assert resp.status == 200, await resp.text()
            await resp.read()
    assert prefill.request_ids == decode.request_ids
    ids = prefill.request_ids
    assert len(set(ids)) == 2 and all(i is not None and i.startswith("r7-") for i in ids)


async def test_routes_one_engine_answers_come_from_a_decode_as_it_answers(
    prefill: Prefill, decode: Decode
) -> None:
    """vLLM's server answers these too, and a client of the proxy calls them (to count
    tokens, say): before, 404."""
    headers = {"Authorization": "Bearer k"}
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/tokenize", json={"prompt": "a b"}, headers=headers)
        assert resp.status == 200
        assert await resp.json() == {"tokens": PROMPT_IDS, "by": "decode-model", "key": "Bearer k"}
        resp = await client.post("/v1/completions/render", json={"prompt": "a b"})
        assert resp.status == 200  # a route the proxy has no list of, as vLLM adds them
        resp = await client.get("/v1/completions")  # the decode's own answer: 405
        assert resp.status == 405
    assert [path for path, _ in decode.requests] == ["/tokenize", "/v1/completions/render"]
    assert prefill.requests == []


ONE_ENGINE_ROUTES = [("POST", "/sleep"), ("POST", "/v1/load_lora_adapter"), ("GET", "/metrics"),
                     ("POST", "/reset_prefix_cache")]  # fmt: skip


@pytest.mark.parametrize(("method", "path"), ONE_ENGINE_ROUTES)
async def test_a_route_that_acts_on_one_engine_is_refused_by_name(
    prefill: Prefill, decode: Decode, method: str, path: str
) -> None:
    """Through the proxy it would reach one engine of the fleet (one decode asleep, one with
    the adapter, one decode's figures passed off as the fleet's)."""
    async with proxy([prefill.url], [decode.url]) as client:
        error = await error_of(await client.request(method, path, json={}), 404)
    assert f"{method} {path}" in error["message"] and "each engine" in error["message"]


async def test_a_stored_response_comes_from_the_decode_that_holds_it(prefill: Prefill) -> None:
    decodes = [Decode("d1"), Decode("d2")]
    for backend in decodes:
        await backend.start()
    decodes[1].stored.add("resp_1")
    try:
        async with proxy([prefill.url], [d.url for d in decodes]) as client:
            for _ in range(2):  # whichever decode the pool would pick first
                resp = await client.get("/v1/responses/resp_1")
                assert resp.status == 200 and (await resp.json())["by"] == "decode-model"
            assert (await client.get("/v1/responses/resp_2")).status == 404  # nobody's
    finally:
        for backend in decodes:
            await backend.stop()


async def test_a_stored_response_is_found_past_a_dead_decode(prefill: Prefill) -> None:
    """One decode SIGKILLed beside the one that holds the response: the holder answers.
    Before, the search stopped at the dead decode with a 503."""
    holder = Decode("d2")
    await holder.start()
    holder.stored.add("resp_1")
    try:
        async with proxy([prefill.url], [dead_url(), holder.url], routing="pairs") as client:
            for _ in range(2):
                resp = await client.get("/v1/responses/resp_1")
                assert resp.status == 200, await resp.text()
            resp = await client.get("/v1/responses/resp_2")
            assert resp.status == 404 and await resp.json() == {"error": {"message": "not found"}}
    finally:
        await holder.stop()


async def test_a_response_continuing_a_stored_one_goes_to_the_decode_alone(
    prefill: Prefill, decode: Decode
) -> None:
    """The prefill does not hold the earlier response, and would refuse the leg."""
    body = {"model": "m", "input": "and then?", "previous_response_id": "resp_1"}
    decode.stored.add("resp_1")
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/responses", json=body)
        assert await resp.json() == decode.answer_for(body)
    assert prefill.requests == [] and decode.requests == [("/v1/responses", body)]


async def test_a_response_continuing_a_stored_one_finds_the_decode_that_holds_it(
    prefill: Prefill,
) -> None:
    """Several decodes, one holding the earlier response (vLLM's store is per server): the
    request reaches it, streamed or not, whichever decode routing picks first; an id that
    no decode holds gets the decodes' 404. Before, it went to the decode routing picked,
    and got that one's 404."""
    other, holder = Decode("d1"), Decode("d2")
    for backend in (other, holder):
        await backend.start()
    holder.stored.add("resp_1")
    holder.go.set()
    body = {"model": "m", "input": "and then?", "previous_response_id": "resp_1"}
    try:
        async with proxy([prefill.url], [other.url, holder.url], routing="pairs") as client:
            for stream in (False, False, True, True):  # each decode picked first once
                resp = await client.post("/v1/responses", json={**body, "stream": stream})
                text = await resp.text()
                assert resp.status == 200, text
                assert ("d2 says hi" in text) if not stream else (text.encode() == b"".join(CHUNKS))
            resp = await client.post("/v1/responses", json={**body, "previous_response_id": "x"})
            assert resp.status == 404 and await resp.json() == {"error": {"message": "not found"}}
        held = [b for _, b in holder.requests if b["previous_response_id"] == "resp_1"]
        assert prefill.requests == [] and len(held) == 4
    finally:
        for backend in (other, holder):
            await backend.stop()


async def test_no_limit_of_the_proxy_s_own_cuts_a_long_answer_short(
    prefill: Prefill, side: SideChannel
) -> None:
    """A decode that takes long to answer (a long answer not streamed): the proxy waits, as
    vLLM's server sets no limit, until the client gives up; then the staging is released.
    Before, 504 after 600 s, however long the client would have waited."""
    with socket.socket() as silent:  # listens (the kernel completes connections), never answers
        port = free_port()
        silent.bind(("127.0.0.1", port))
        silent.listen(8)
        async with proxy([prefill.url], [f"http://127.0.0.1:{port}"]) as client:
            with pytest.raises(asyncio.TimeoutError):
                await client.post("/v1/completions", json=PROMPT, timeout=aiohttp.ClientTimeout(2))
            assert await side.wait_released("pf-1") == ["pf-1"]


async def test_a_backend_that_takes_no_connection_costs_a_retry_on_another(
    prefill: Prefill, decode: Decode, monkeypatch
) -> None:
    """A host that drops connection attempts (down, or its accept queue full) is down: the
    next decode serves. Before, the request waited for the whole leg's limit, then 504."""
    monkeypatch.setattr(legs, "CONNECT_TIMEOUT_S", 0.5)
    with socket.socket() as full:
        port = free_port()
        full.bind(("127.0.0.1", port))
        full.listen(0)  # never accepts: after its queue fills, the kernel drops new attempts
        queued: list[socket.socket] = []
        with contextlib.suppress(TimeoutError):  # fill its queue: then an attempt times out
            while len(queued) < 8:
                queued.append(socket.create_connection(("127.0.0.1", port), timeout=0.3))
        assert len(queued) < 8, "the kernel took every connection: no host drops them here"
        try:
            async with proxy([prefill.url], [f"http://127.0.0.1:{port}", decode.url],
                             routing="pairs") as client:  # fmt: skip
                resp = await client.post("/v1/completions", json=PROMPT, timeout=WAIT_S * 2)
                assert resp.status == 200, await resp.text()
        finally:
            for conn in queued:
                conn.close()
    assert len(decode.requests) == 1


async def test_a_client_leaving_mid_stream_aborts_the_decode_and_releases(
    prefill: Prefill, decode: Decode, side: SideChannel
) -> None:
    decode.answer = "endless"
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
        assert await resp.content.readany()
        resp.close()  # the client goes away
        await asyncio.wait_for(decode.aborted.wait(), WAIT_S)
        assert await side.wait_released("pf-1") == ["pf-1"]


# --- the client's first token from the prefill ----------------------------------------------


async def test_the_decode_continues_from_the_prefills_token(
    prefill: Prefill, decode: Decode
) -> None:
    prefill.token_ids = True
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json={**PROMPT, "temperature": 0})
        answer = await resp.json()
    [(_, to_prefill)] = prefill.requests
    [(_, to_decode)] = decode.requests
    assert to_prefill["return_token_ids"] is True
    assert to_decode == {
        **PROMPT,
        "temperature": 0,
        "prompt": PROMPT_IDS + [FIRST_ID],  # the prompt and the prefill's token
        "max_tokens": PROMPT["max_tokens"] - 1,
        "request_id": "p",  # the decode's answer and events carry the prefill's id
        "kv_transfer_params": prefill.params[0],
    }
    assert answer["choices"][0]["text"] == "x" + "decode says hi"
    # The decode counted the first token as prompt; the client counts it as answer.
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


async def test_a_streamed_list_of_prompts_is_one_stream_as_vllm_streams_it(
    prefill: Prefill, decode: Decode
) -> None:
    """Each prompt handed off alone, their events in one stream: prompt p's choices at
    p * n + i, one id, the usage summed into one event at the end, one [DONE]. Before, the
    proxy refused such a request (HTTP 400) that vLLM serves."""
    decode.answer, decode.go = "usage", asyncio.Event()
    decode.go.set()
    body = {"prompt": ["a", "b", "c"], "stream": True, "stream_options": {"include_usage": True}}
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        received = await resp.read()
    events = [e[6:] for e in received.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    payloads = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    for p in payloads[:-1]:
        [choice] = p["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "Hello!", 1: "Hello!", 2: "Hello!"}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"] == {
        "prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}  # fmt: skip
    assert len({p.get("id") for p in payloads}) == 1
    assert sorted(b["prompt"] for _, b in decode.requests) == ["a", "b", "c"]
    assert len(prefill.requests) == 3


async def test_a_streamed_list_whose_prompts_all_fail_is_their_error(
    prefill: Prefill, decode: Decode
) -> None:
    """A stream the prefill refuses is the decode's to answer, as vLLM alone would: its own
    400 where it refuses before streaming (here), an error event where while generating."""
    prefill.answer = decode.answer = "reject"
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json={"prompt": ["a", "b"], "stream": True})
        assert await resp.json() == Prefill.REJECTION and resp.status == 400
    assert len(decode.requests) == 2


async def test_a_refusal_the_decode_cannot_answer_itself_is_the_prefill_s(
    prefill: Prefill, decode: Decode
) -> None:
    """A decode that does not prefill (a QAIC decode answers 503 without a ticket) or
    breaks leaves the client the prefill's refusal, not a 502 naming the decode."""
    prefill.answer, decode.answer = "reject", "text"
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json=PROMPT)
        assert resp.status == 400 and await resp.json() == Prefill.REJECTION
    assert len(decode.requests) == 1


async def test_a_stream_refused_by_the_prefill_is_answered_by_the_decode(
    prefill: Prefill, decode: Decode
) -> None:
    """vLLM refuses some parameters only while generating (logit_bias under speculative
    decoding): a stream then answers 200 with an error event, where the prefill leg (not
    streamed) answers 400. The decode, which streams, answers the client as vLLM would."""
    prefill.answer, decode.extra = "reject", [b'data: {"error": {"message": "no"}}\n\n']
    decode.go.set()
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
        assert resp.status == 200 and b'{"error": {"message": "no"}}' in await resp.read()
    assert not decode.requests[0][1].get("kv_transfer_params")  # computed there, no ticket


async def test_a_stream_starts_with_the_prefills_token_once_the_decode_took_the_request(
    prefill: Prefill, decode: Decode
) -> None:
    prefill.token_ids = True
    decode.go.set()
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
        received = await resp.read()
    events = [json.loads(e[6:]) for e in received.split(b"\n\n") if e.startswith(b"data: {")]
    first = events[0]
    assert first["id"] == "cmpl-p" and "usage" not in first  # as vLLM streams a chunk
    assert first["choices"][0]["text"] == "x" and first["choices"][0]["finish_reason"] is None
    assert received.endswith(b"".join(CHUNKS))  # then the decode's events as they came


async def test_usage_a_decode_streams_unasked_counts_the_first_token_as_answer(
    prefill: Prefill, decode: Decode
) -> None:
    """A decode run with --enable-force-include-usage streams usage the client did not ask
    for; it counted the prefill's token as prompt (billing one token off)."""
    prefill.token_ids, decode.answer = True, "usage"
    decode.go.set()
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json={**PROMPT, "stream": True})
        received = await resp.read()
    events = [json.loads(e[6:]) for e in received.split(b"\n\n") if e.startswith(b"data: {")]
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["a stop", "max_tokens 1"])
async def test_an_answer_ending_at_the_prefills_token_needs_no_decode(
    prefill: Prefill, decode: Decode, side: SideChannel, stream: bool, how: str
) -> None:
    prefill.token_ids = True
    body = {**PROMPT, "stream": stream, "stream_options": {"include_usage": True}}
    if how == "a stop":
        prefill.finish_reason = "stop"
    else:
        body["max_tokens"] = 1
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    assert decode.requests == []
    assert await side.wait_released("pf-1") == ["pf-1"]  # its staging is not needed
    if not stream:
        answer = json.loads(raw)
        assert answer["choices"][0]["text"] == "x" and "kv_transfer_params" not in answer
        return
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert [c["text"] for e in events for c in e["choices"]] == ["x"]
    assert events[-1]["usage"]["completion_tokens"] == 1 and raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {}),
        ("/v1/completions", {"stop": ["\n"]}),
        ("/v1/completions", {"logprobs": 2, "logprob_token_ids": [5]}),
        ("/v1/completions", {"presence_penalty": 0.5}),
        ("/v1/completions", {"n": 3, "temperature": 0.9}),
        ("/v1/chat/completions", {"n": 2, "temperature": 0.9}),
    ],
    ids=["chat", "stop", "logprob-token-ids", "penalty", "n=3", "chat-n=2"],
)
async def test_options_spanning_the_first_token_keep_the_decodes_own(
    prefill: Prefill, decode: Decode, path: str, extra: dict[str, Any]
) -> None:
    prefill.token_ids = True
    body = {**PROMPT, **extra}
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post(path, json=body)
        assert await resp.json() == decode.answer_for(body)
    assert "return_token_ids" not in prefill.requests[0][1]
    assert prefill.requests[0][1]["n"] == 1  # n choices on the decode, all from one ticket
    assert decode.requests[0][1] == {**body, "kv_transfer_params": prefill.params[0]}


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/completions", {"echo": True, "logprobs": 1}),
        ("/v1/completions", {"prompt_logprobs": 1}),
        ("/v1/chat/completions", {"prompt_logprobs": 0}),
    ],
    ids=["echo-logprobs", "prompt-logprobs", "chat-prompt-logprobs"],
)
async def test_a_request_scoring_its_prompt_goes_to_the_decode_alone(
    prefill: Prefill, decode: Decode, path: str, extra: dict[str, Any]
) -> None:
    """vLLM computes a prompt whose logprobs are asked for, reading no cache: handed-off
    KV would go unused, so there is no prefill leg."""
    body = {**PROMPT, **extra}
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post(path, json=body)
        assert await resp.json() == decode.answer_for(body)
    assert prefill.requests == [] and decode.requests[0][1] == body


@pytest.mark.parametrize("why", ["--first-token decode", "staged one short"])
async def test_the_decodes_own_first_token_otherwise(
    prefill: Prefill, decode: Decode, why: str
) -> None:
    prefill.token_ids = True
    if why == "staged one short":
        prefill.staged_tokens = len(PROMPT_IDS) - 1
    first_from_prefill = why != "--first-token decode"
    async with proxy(
        [prefill.url], [decode.url], first_token_from_prefill=first_from_prefill
    ) as client:
        resp = await client.post("/v1/completions", json=PROMPT)
        assert await resp.json() == decode.answer_for(PROMPT)
    assert decode.requests[0][1] == {**PROMPT, "kv_transfer_params": prefill.params[0]}


def test_usage_in_the_decodes_stream_counts_the_first_token_as_answer() -> None:
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    line = f"data: {json.dumps({'choices': [], 'usage': usage})}\n".encode()
    fixed = json.loads(first_token.fix_event(line)[6:])
    assert fixed["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    for untouched in (CHUNKS[0].split(b"\n")[0] + b"\n", b"data: [DONE]\n", b"\n"):
        assert first_token.fix_event(untouched) == untouched


# --- the proxy needs neither torch nor vLLM ----------------------------------------------------

BLOCKED = ("torch", "vllm", "numpy")
NO_HEAVY_IMPORTS = (
    "import runpy, sys\n"
    f"for name in {BLOCKED!r}: sys.modules[name] = None  # an import of it fails\n"
    "runpy.run_module('vllm_qaic_proxy', run_name='__main__')\n"
)


async def test_the_proxy_runs_with_torch_vllm_and_numpy_absent(
    prefill: Prefill, decode: Decode, side: SideChannel
) -> None:
    """As an operator runs it on a router host: its own process, none of those installed.
    Every path that reads a ticket (the first token, an early release) runs."""
    prefill.token_ids = True
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", NO_HEAVY_IMPORTS, "--port", str(port),
        "--prefill", prefill.url, "--decode", decode.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError):
                    async with client.get("/health") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.1)
            resp = await client.post("/v1/completions", json={**PROMPT, "temperature": 0})
            answer = await resp.json()
            assert answer["choices"][0]["text"] == "x" + "decode says hi", answer
            assert decode.requests[0][1]["prompt"] == PROMPT_IDS + [FIRST_ID]  # first token
            decode.answer = "text"  # a failed decode leg: the staging is released early
            resp = await client.post("/v1/completions", json={**PROMPT, "temperature": 0})
            assert resp.status == 502
            assert "pf-2" in await side.wait_released("pf-2")
    finally:
        proc.terminate()
        out, _ = await proc.communicate()
    assert b"Error" not in out, out.decode()[-2000:]


class TurnKeeper(Decode):
    """A decode with ``reuse_turns``: a turn it is asked to keep comes back with a ticket,
    which its side channel (``side``) gives by the turn's name too (a stream carries none)."""

    def __init__(self, side: SideChannel) -> None:
        super().__init__()
        self.side = side
        self.go.set()  # streams come through at once

    async def complete(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if name := (body.get("kv_transfer_params") or {}).get("turn_id"):
            kept = staged(f"turn-{len(self.requests)}", self.side.server.port)
            self.side.turns[name] = msgspec.convert(kept, RemotePrefill)
        return await super().complete(request, body)

    def answer_for(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = super().answer_for(body)
        if name := (body.get("kv_transfer_params") or {}).get("turn_id"):
            answer["kv_transfer_params"] = msgspec.to_builtins(self.side.turns[name])
        return answer


async def test_with_reuse_turns_the_next_turn_s_prefill_gets_the_kept_turn_and_it_is_released(
    prefill: Prefill, side: SideChannel
) -> None:
    decode = TurnKeeper(side)
    await decode.start()
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    try:
        async with proxy([prefill.url], [decode.url], reuse_turns=True) as client:
            first = {**PROMPT, "prompt": "hi"}
            resp = await client.post("/v1/completions", json=first, headers=alice)
            said = (await resp.json())["choices"][0]["text"]
            assert isinstance(decode.requests[0][1]["kv_transfer_params"]["turn_id"], str)
            later = {**PROMPT, "prompt": f"hi{said} and then?"}
            await client.post("/v1/completions", json=later, headers=bob)  # not bob's turn
            await client.post("/v1/completions", json=later, headers=alice)
            await client.post("/v1/completions", json=later, headers=alice)  # taken once
        turns = [body["kv_transfer_params"].get("earlier_turn") for _, body in prefill.requests]
        # The same prompt again continues the turn that the third request's answer ended.
        assert [t and t["remote_request_id"] for t in turns] == [None, None, "turn-1", "turn-3"]
        assert "turn-1" in await side.wait_released("turn-1")  # the decode may free it
    finally:
        await decode.stop()


@pytest.mark.parametrize("decode_kv", [True, False])
async def test_with_reuse_turns_a_streamed_turn_s_ticket_comes_from_the_decode_s_side_channel(
    prefill: Prefill, side: SideChannel, decode_kv: bool
) -> None:
    decode = TurnKeeper(side)
    await decode.start()
    kv = [f"127.0.0.1:{side.server.port}"] if decode_kv else None
    made = Proxy([prefill.url], [decode.url], kv, reuse_turns=True)
    try:
        async with served(made) as client:
            first = {**PROMPT, "prompt": "hi", "stream": True}
            said = await (await client.post("/v1/completions", json=first)).text()
            assert said.endswith("data: [DONE]\n\n")
            await kept_turns(made, 1 if decode_kv else 0)  # asked for after the stream ended
            later = {**PROMPT, "prompt": "hi there"}  # kept by its request's text alone
            await client.post("/v1/completions", json=later)
        asked = decode.requests[0][1]["kv_transfer_params"].get("turn_id")
        turns = [body["kv_transfer_params"].get("earlier_turn") for _, body in prefill.requests]
        if not decode_kv:  # no side channel to ask: not kept
            assert asked is None and turns == [None, None]
            return
        assert turns == [None, msgspec.json.decode(msgspec.json.encode(side.turns[asked]))]
        assert "turn-1" in await side.wait_released("turn-1")  # the decode may free it
    finally:
        await decode.stop()


async def kept_turns(made: Proxy, n: int) -> None:
    """Waits (at most WAIT_S) until ``made`` keeps ``n`` turns."""
    deadline = time.monotonic() + WAIT_S
    while len(made.turns) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


# --- tickets stay between the proxy and the engines -------------------------------------------

# What a hostile client puts in a request: each connector field, and vLLM's side door to them
# (vllm_xargs, merged into the same request arguments). Every value names "forged".
FORGED = {
    "do_remote_decode": True, "do_remote_prefill": True, "keep_turn": True, "turn_id": "forged",
    "earlier_turn": {**staged("forged", 1), "block_ids": [0, 1, 2]}, "block_ids": [0, 1, 2],
    "remote_host": "forged.example", "remote_request_id": "forged",
}  # fmt: skip
FORGING = {"kv_transfer_params": FORGED, "vllm_xargs": {"kv_transfer_params": "forged"}}
# Events that carry a ticket, as vLLM's may: a chunk's own, and a Responses event's response.
TICKETED = [
    f"data: {json.dumps({'choices': [], 'kv_transfer_params': staged('s', 1)})}\n\n".encode(),
    b"event: response.completed\ndata: "
    + json.dumps({"type": "response.completed", "response": {"kv_transfer_params":
                  staged("r", 1)}}).encode() + b"\n\n",
]  # fmt: skip


class Ticketing(Decode):
    """A decode whose every answer carries a ticket: whole, and among its stream's events."""

    def __init__(self) -> None:
        super().__init__()
        self.go.set()  # streams come through at once
        self.extra = TICKETED

    def answer_for(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**super().answer_for(body), "kv_transfer_params": staged("d", 1)}


@pytest.fixture
async def ticketing() -> AsyncIterator[Ticketing]:
    backend = Ticketing()
    await backend.start()
    yield backend
    await backend.stop()


def saw_no_forgery(prefill: Prefill, *decodes: Backend) -> None:
    """No engine saw a connector field the client sent: each leg carries the proxy's own
    kv_transfer_params (the prefill leg's ask, the prefill's ticket, a turn's) or none."""
    for path, body in [*prefill.requests, *(r for d in decodes for r in d.requests)]:
        assert "forged" not in json.dumps(body), (path, body)
        params = {**(body.get("kv_transfer_params") or {})}
        for own in ("keep_turn", "turn_id", "earlier_turn"):  # the proxy's, where it keeps turns
            params.pop(own, None)
        assert params in ({}, {"do_remote_decode": True}, *prefill.params), (path, body)


def shows_no_ticket(raw: bytes) -> None:
    """No ticket reached the client: none of a ticket's bytes, any kv_transfer_params null."""
    assert b"feedfacefeedface" not in raw, raw  # every stand-in ticket's incarnation
    assert b'"kv_transfer_params"' not in re.sub(rb'"kv_transfer_params": ?null', b"", raw)


# A request of each kind the proxy serves, by the path it takes through the proxy.
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", {"prompt": "a b"}),
    "completions-first-token": ("/v1/completions", {"prompt": "a b", "temperature": 0}),
    "token-ids": ("/v1/completions", {"prompt": [5, 6, 7]}),
    "prompt-list": ("/v1/completions", {"prompt": ["a", [5, 6]]}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "a"}]}),
    "responses": ("/v1/responses", {"input": [{"role": "user", "content": "a"}]}),
    "responses-previous": ("/v1/responses", {"input": "b", "previous_response_id": "resp_1"}),
    "alone-prompt-logprobs": ("/v1/completions", {"prompt": "a b", "prompt_logprobs": 1}),
    "alone-echo": ("/v1/completions", {"prompt": "a b", "echo": True, "logprobs": 1}),
}


@pytest.mark.parametrize("reuse", [False, True], ids=["", "reuse-turns"])
@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("route", list(ROUTES))
async def test_forged_params_reach_no_engine_and_no_ticket_reaches_the_client(
    prefill: Prefill, ticketing: Ticketing, route: str, stream: bool, reuse: bool
) -> None:
    """Before, a client's kv_transfer_params went whole to the decode on the paths the proxy
    passes through (prompt logprobs, previous_response_id...), and every whole answer with
    --reuse-turns showed the client the decode's turn ticket."""
    path, body = ROUTES[route]
    prefill.token_ids = route == "completions-first-token"
    ticketing.stored.add("resp_1")
    async with proxy([prefill.url], [ticketing.url], reuse_turns=reuse) as client:
        resp = await client.post(path, json={**PROMPT, **body, **FORGING, "stream": stream})
        raw = await resp.read()
        assert resp.status == 200, raw
    assert ticketing.requests, "the decode answered"
    saw_no_forgery(prefill, ticketing)
    shows_no_ticket(raw)


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_with_no_decode_the_prefill_answering_whole_sees_no_forgery_and_shows_no_ticket(
    prefill: Prefill, stream: bool
) -> None:
    prefill.extra = TICKETED
    async with proxy([prefill.url], [dead_url()]) as client:
        resp = await client.post("/v1/completions", json={**PROMPT, **FORGING, "stream": stream})
        raw = await resp.read()
        assert resp.status == 200, raw
    [(_, leg), (_, whole)] = prefill.requests
    assert leg["kv_transfer_params"] == {"do_remote_decode": True}
    assert whole == {**PROMPT, "vllm_xargs": {}, "stream": stream}
    shows_no_ticket(raw)


@pytest.mark.parametrize(
    ("path", "data"),
    [
        ("/inference/v1/generate", json.dumps({"token_ids": [5], **FORGING}).encode()),
        ("/inference/v1/generate", json.dumps({"stream": True, **FORGING}).encode()),
        ("/inference/v1/generate", b'{"token_ids": [5], "kv\\u005ftransfer_params": {"a": 1}}'),
        ("/tokenize", json.dumps({"prompt": "a", **FORGING}).encode()),
    ],
    ids=["generate", "generate-stream", "generate-escaped", "tokenize"],
)  # fmt: skip
async def test_a_relayed_route_sees_no_forgery_and_shows_no_ticket(
    prefill: Prefill, decode: Decode, path: str, data: bytes
) -> None:
    """vLLM's /inference/v1/generate takes kv_transfer_params and returns them: relayed as
    bytes, a client's reached the decode, and the decode's the client."""
    headers = {"Content-Type": "application/json"}
    async with proxy([prefill.url], [decode.url]) as client:
        resp = await client.post(path, data=data, headers=headers)
        raw = await resp.read()
        assert resp.status == 200, raw
    [(_, seen)] = decode.requests
    assert "kv_transfer_params" not in seen and "forged" not in json.dumps(seen), seen
    shows_no_ticket(raw)


async def test_streams_end_on_time_with_the_decode_s_side_channel_gone(
    prefill: Prefill, side: SideChannel
) -> None:
    """A streamed turn's ticket comes from the decode's side channel. With that side channel
    gone (here a port nothing listens on), 12 streams got [DONE] at once and their end 5 and
    10 s later: the proxy asked for the ticket before it ended them. Now it asks after."""
    decode = TurnKeeper(side)
    await decode.start()
    made = Proxy([prefill.url], [decode.url], [f"127.0.0.1:{free_port()}"], reuse_turns=True)

    async def gap(client: aiohttp.ClientSession, n: int) -> float:
        body = {**PROMPT, "prompt": f"hi {n}", "stream": True}
        resp = await client.post("/v1/completions", json=body)
        done = None
        async for line in resp.content:  # to the stream's end
            done = time.monotonic() if line == b"data: [DONE]\n" else done
        assert done is not None
        return time.monotonic() - done

    try:
        async with served(made) as client:
            gaps = await asyncio.gather(*(gap(client, n) for n in range(12)))
    finally:
        await decode.stop()
    print(f"[DONE] to the stream's end, 12 streams: max {max(gaps) * 1e3:.2f} ms, "
          f"mean {sum(gaps) / len(gaps) * 1e3:.2f} ms")  # fmt: skip
    assert all(body["kv_transfer_params"].get("keep_turn") for _, body in decode.requests)
    # Far under the time one ticket fetch may wait: no stream's end waited on one.
    assert max(gaps) < legs.TURN_TIMEOUT_S / 2, gaps
    assert len(made.turns) == 0  # none fetched: each decode's lease frees its turn


async def test_a_streamed_turn_s_ticket_comes_from_the_decode_that_answered(
    prefill: Prefill, side: SideChannel
) -> None:
    """The routed decode is dead, and another answers the stream: that one's side channel
    holds the turn. Before, the dead one's was asked (and the stream's end waited on it)."""
    decode = TurnKeeper(side)
    await decode.start()
    decode_kv = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{side.server.port}"]
    made = Proxy([prefill.url], [dead_url(), decode.url], decode_kv, routing="pairs",
                 reuse_turns=True)  # fmt: skip
    try:
        async with served(made) as client:
            first = {**PROMPT, "prompt": "hi", "stream": True}
            assert (await (await client.post("/v1/completions", json=first)).read()).endswith(
                CHUNKS[-1])  # fmt: skip
            await kept_turns(made, 1)
            await client.post("/v1/completions", json={**PROMPT, "prompt": "hi there"})
    finally:
        await decode.stop()
    turns = [body["kv_transfer_params"].get("earlier_turn") for _, body in prefill.requests]
    assert turns[0] is None and turns[1]["remote_request_id"] == "turn-1"
