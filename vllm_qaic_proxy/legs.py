"""The legs: each HTTP call the proxy makes to a backend engine, and how one fails.

A failed leg is a `LegError` naming it: 503 unreachable, 504 timed out, 502 a bad answer; a
backend's own 4xx goes to the client as it came. `NoAnswer` (no connection, or closed before
its headers) lets another backend of the same kind take the request (`Legs.failover`).
An engine's ticket in an answer, whole, streamed or relayed, is the proxy's, never the
client's (`apis.Events`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp
import msgspec
from aiohttp import web

from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.ticket import parse_remote_prefill
from vllm_qaic_connector.protocol.wire import TurnReply, TurnRequest
from vllm_qaic_proxy import apis, first_token, prompt_lists
from vllm_qaic_proxy.first_token import FirstToken
from vllm_qaic_proxy.routing import LeastOutstanding

logger = logging.getLogger(__name__)  # its own program's, not inside vLLM
T = TypeVar("T")
Sink = web.StreamResponse | prompt_lists.Part  # where a stream's events go

ERROR_TYPES = {
    404: "NotFoundError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout",
}  # fmt: skip
# No limit on a leg's time unless the operator sets one: vLLM's server has none, and a long
# answer not streamed (a reasoning model's 30k tokens) takes as long as it takes. A backend
# that accepts no connection in this long is down, and another is tried.
CONNECT_TIMEOUT_S = 10.0
# What a relayed route passes on of the client's request and of the decode's answer.
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
RELAYED_HEADERS = ("Content-Type", "Accept")  # and `credentials`
LEG_HEADERS = web.RequestKey("leg_headers", dict[str, str])  # `credentials`, once a request
# Under vLLM's keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a pooled connection is never
# reused just as the engine's server closes it (the request would fail to send).
BACKEND_KEEPALIVE_S = 4.0
# A streamed turn's ticket is asked of the decode's side channel after the stream, never
# holding its end: by this many threads, each waiting this long at most, this many queued.
TURN_FETCHES, TURN_TIMEOUT_S, TURN_QUEUE = 4, 2.0, 64
# No answer at all: no connection, or closed before its headers (another backend may serve).
UNANSWERED = (
    aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ConnectionTimeoutError,
)  # fmt: skip


class LegError(Exception):
    """A leg failed; ``status`` and the message go to the client."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, body

    def response(self) -> web.Response:
        """The client's answer: a backend's own 4xx as it came, else our error naming the leg."""
        if self.body is not None:
            return web.json_response(self.body, status=self.status)
        logger.warning("request failed (%d): %s", self.status, self)
        return web.json_response(error_body(self.status, str(self)), status=self.status)


class NoAnswer(LegError):
    """The backend gave no answer at all (no connection, or closed before its headers), so
    another backend of the same kind may take the request."""


class NotHere(NoAnswer):
    """The backend is up but does not hold what was asked for (a stored response: vLLM's
    store is per server), so another may; ``body`` is its 404, the answer if none does."""


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """vLLM's (and OpenAI's) error shape."""
    kind = kind or ERROR_TYPES.get(status, "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class Legs:
    """The calls to backends, over one connection pool (opened and closed with the app)."""

    def __init__(
        self, prefill_timeout_s: float | None, decode_timeout_s: float | None, key: bytes | None
    ) -> None:
        self.prefill_timeout_s, self.decode_timeout_s, self.key = (
            prefill_timeout_s, decode_timeout_s, key,
        )  # fmt: skip
        self.session: aiohttp.ClientSession | None = None
        self._releases: set[asyncio.Future[None]] = set()
        self._fetches: set[asyncio.Task[None]] = set()  # streamed turns' tickets
        self._fetcher = ThreadPoolExecutor(TURN_FETCHES, "turn-tickets")
        self._contexts: dict[str, int | None] = {}  # each decode's max_model_len

    async def start(self, _: web.Application) -> None:
        # No cap on connections (aiohttp's is 100, and a stream holds one to its end: the
        # 101st request waited for one to end); the engines queue, as behind vLLM's router.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=BACKEND_KEEPALIVE_S)
        self.session = aiohttp.ClientSession(connector=connector)

    async def stop(self, _: web.Application) -> None:
        for fetch in self._fetches:
            fetch.cancel()
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        if self._releases:
            await asyncio.wait(self._releases, timeout=6)
        if self.session is not None:
            await self.session.close()

    async def open(
        self,
        leg: str,
        url: str,
        timeout: aiohttp.ClientTimeout,
        headers: dict[str, str],
        method: str = "POST",
        **body: Any,
    ) -> aiohttp.ClientResponse:
        """``body``: ``json=`` (a leg) or ``data=`` (a relayed request)."""
        assert self.session is not None
        try:
            return await self.session.request(method, url, timeout=timeout, headers=headers, **body)
        except UNANSWERED as exc:
            raise NoAnswer(
                503, f"{leg} leg {url} is unreachable: {exc or 'no connection'}"
            ) from None
        except asyncio.TimeoutError:
            raise LegError(504, f"{leg} leg {url} timed out") from None
        except aiohttp.ClientError as exc:
            raise LegError(503, f"{leg} leg {url} is unreachable: {exc}") from None

    async def read_json(self, leg: str, url: str, resp: aiohttp.ClientResponse) -> dict[str, Any]:
        """The leg's JSON answer; a backend's 4xx goes to the client as it is."""
        try:
            text = await resp.text()
        except asyncio.TimeoutError:
            raise LegError(504, f"{leg} leg {url} timed out") from None
        except aiohttp.ClientError as exc:
            raise LegError(502, f"{leg} leg {url} broke off its answer: {exc}") from None
        finally:
            resp.release()
        body = None
        with contextlib.suppress(ValueError):
            body = json.loads(text)
        if not isinstance(body, dict):
            raise LegError(
                502, f"{leg} leg {url} answered HTTP {resp.status} with non-JSON: {text[:200]!r}"
            )
        if 400 <= resp.status < 500:
            raise LegError(resp.status, f"{leg} leg: HTTP {resp.status}", body)
        if resp.status != 200:
            error = body.get("error")
            detail = error.get("message") if isinstance(error, dict) else body
            raise LegError(502, f"{leg} leg {url} failed with HTTP {resp.status}: {detail}")
        return body

    async def failover(
        self, pool: LeastOutstanding, first: str, leg: Callable[[str], Awaitable[T]]
    ) -> T:
        """``leg(url)`` on ``first``; where a backend gave no answer at all, on the next one
        that is up (a dead engine costs its requests a retry, not an error), and that
        backend is skipped for a while."""
        tried = pool.failover(first)
        for url in tried:
            try:
                with pool.busy(url):
                    return await leg(url)
            except NoAnswer as exc:
                if not isinstance(exc, NotHere):
                    pool.mark_down(url)
                if url == tried[-1]:
                    raise
                logger.warning("%s; trying the next", exc)
        raise AssertionError("no backend tried")

    async def prefill(self, url: str, body: dict[str, Any], auth: dict[str, str]) -> dict[str, Any]:
        timeout = leg_timeout(total=self.prefill_timeout_s)
        resp = await self.open("prefill", url, timeout, auth, json=body)
        return await self.read_json("prefill", url, resp)

    def release(self, params: dict[str, Any]) -> None:
        """Free the prefill's staging now rather than at lease end (in the background)."""
        try:
            remote = parse_remote_prefill(params)
        except ValueError:
            return

        release = side_channel.release
        task = asyncio.get_running_loop().run_in_executor(None, release, remote, self.key, 5.0)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def turn(self, decode_kv: str, name: str, kept: Callable[[Any], None]) -> None:
        """Asks the side channel ``decode_kv`` (HOST:PORT) of the decode that answered a stream
        for the ticket of the turn it kept as ``name``, and gives it to ``kept``: in the
        background (`TURN_FETCHES`). A turn not fetched is logged: the decode's lease frees it."""
        if not decode_kv or len(self._fetches) >= TURN_QUEUE:
            why = "that decode has no --decode-kv" if not decode_kv else "too many queued"
            logger.warning("no ticket for a streamed turn: %s", why)
            return
        fetch = asyncio.ensure_future(self._turn(decode_kv, name, kept))
        self._fetches.add(fetch)
        fetch.add_done_callback(self._fetches.discard)

    async def _turn(self, decode_kv: str, name: str, kept: Callable[[Any], None]) -> None:
        host, port = decode_kv.rsplit(":", 1)
        call = functools.partial(
            side_channel.call, host, int(port), TurnRequest(name), self.key, TURN_TIMEOUT_S
        )
        try:
            reply = await asyncio.get_running_loop().run_in_executor(self._fetcher, call)
        except ConnectionError as exc:
            logger.warning("no ticket for a streamed turn: %s", exc)
            return
        if isinstance(reply, TurnReply):
            kept(msgspec.to_builtins(reply.ticket))

    async def answer(
        self,
        request: web.Request,
        base: str,
        body: dict[str, Any],
        headers: dict[str, str],
        first: FirstToken | None,
        leg: str = "decode",
        sink: Sink | None = None,
        kept: Callable[[str, Any], None] | None = None,
    ) -> tuple[web.StreamResponse, bool]:
        """The leg's answer from ``base``: whole (``first`` put back in front, with the
        ``headers``), or the events through as they come (after ``first``'s, once the decode
        has taken the request), to the client or into ``sink``; False when the client went
        away. Then the decode's connection is closed, which aborts the request there. Its
        ticket, if any, is not the client's (`apis.taken`): once the answer came through
        whole, ``kept`` gets ``base`` and the ticket (called, not awaited)."""
        url, streamed = base + request.path, body.get("stream")
        limit = self.decode_timeout_s  # a stream's: the longest gap between events
        timeout = leg_timeout(sock_read=limit) if streamed else leg_timeout(total=limit)
        resp = await self.open(leg, url, timeout, credentials(request), json=body)
        if not streamed:
            answer = await self.read_json(leg, base, resp)
            ticket = apis.taken(answer)
            if kept is not None:
                kept(base, ticket)
            answer = first.joined(answer) if first else answer
            return web.json_response(answer, headers=headers), True
        if resp.status != 200 or "json" in resp.content_type:
            await self.read_json(leg, url, resp)  # raises: a stream answers 200 with events
            raise LegError(502, f"{leg} leg {url} answered a stream request with JSON")
        headers["Content-Type"] = resp.headers.get("Content-Type", "")
        out: Sink = sink or web.StreamResponse(headers=headers)
        events = apis.Events()
        try:
            await out.prepare(request)
            if first is not None:  # any usage after it (asked, or forced) counts it as answer
                await out.write(first.events(body.get("stream_options"), final_usage=False))
                async for line in resp.content:
                    await out.write(first_token.fix_event(events.line(line), first.shift))
            else:
                async for chunk in resp.content.iter_any():
                    await out.write(events.feed(chunk))
                await out.write(events.end())
            if kept is not None:  # before the client sees the end, which it does not hold
                kept(base, events.ticket)
            await out.write_eof()
        except ConnectionResetError:
            logger.info("client went away mid-stream; aborting the decode request")
            return response_of(out), False
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # Headers are out: the client learns of the failure as a last event.
            logger.warning("%s leg %s broke off a stream: %s", leg, url, exc)
            err = error_body(502, f"{leg} leg {url} broke off the stream: {exc}")
            with contextlib.suppress(ConnectionResetError):
                await out.write(f"data: {json.dumps(err)}\n\n".encode())
            return response_of(out), False
        finally:
            resp.close()  # before the end of the stream: the decode aborts the request
        return response_of(out), True

    async def context(self, decode_url: str, auth: dict[str, str]) -> int | None:
        """The decode's max_model_len, from its /v1/models once; None where it names none
        (a decode without that route, the QAIC emulator's, is not asked again; one that did
        not answer, or refused the client's credentials, is)."""
        if decode_url not in self._contexts:
            assert self.session is not None
            timeout = aiohttp.ClientTimeout(total=5)
            url = decode_url + "/v1/models"
            try:
                async with self.session.get(url, timeout=timeout, headers=auth) as resp:
                    text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return None
            if resp.status in (401, 403):
                return None
            found = None
            with contextlib.suppress(ValueError, LookupError, TypeError):  # not vLLM's card
                found = json.loads(text)["data"][0]["max_model_len"]
            self._contexts[decode_url] = found if isinstance(found, int) else None
        return self._contexts[decode_url]

    async def relay(
        self, request: web.Request, url: str, data: bytes, headers: dict[str, str], stored: bool
    ) -> web.StreamResponse:
        """``url``'s answer to the client's request, streamed back; a 404 for a ``stored``
        response is raised (`NotHere`: another decode may hold it)."""
        target = url + request.path_qs
        resp = await self.open("decode", target, leg_timeout(), headers, request.method, data=data)
        try:
            if resp.status == 404 and stored:
                missing = None
                with contextlib.suppress(ValueError, aiohttp.ClientError):
                    missing = await resp.json(content_type=None)
                raise NotHere(404, f"{url} does not hold it", missing)  # another decode may
            kept = {k: v for k in ("Content-Type",) if (v := resp.headers.get(k)) is not None}
            out = web.StreamResponse(status=resp.status, headers=kept)
            text = "json" in resp.content_type or "event-stream" in resp.content_type
            events = apis.Events() if text else None  # without tickets
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(events.feed(chunk) if events else chunk)
                await out.write(events.end() if events else b"")
                await out.write_eof()
            return out
        finally:
            resp.close()

    async def health(self, url: str) -> str:
        assert self.session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=3)
            async with self.session.get(url + "/health", timeout=timeout) as resp:
                return "ok" if resp.status == 200 else f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"unreachable: {exc or type(exc).__name__}"


def credentials(request: web.Request) -> dict[str, str]:
    """The client's headers that the legs carry: its credentials, for the backends to check
    (``vllm serve --api-key``), and its request id, which vLLM takes as the request's own (so
    both legs' logs name the client's id, as behind llm-d's sidecar). The id gets a suffix
    of this request's own, as vLLM's randomization adds: an engine run without it
    (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION) never sees a client's repeated id twice."""
    if LEG_HEADERS not in request:
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        if "X-Request-Id" in headers:
            headers["X-Request-Id"] += f"-{secrets.token_hex(4)}"
        request[LEG_HEADERS] = headers
    kept: dict[str, str] = request[LEG_HEADERS]
    return dict(kept)


def response_of(out: Sink) -> web.StreamResponse:
    """The client's response that ``out`` writes to."""
    return out.response if isinstance(out, prompt_lists.Part) else out


def answer_of(response: web.StreamResponse) -> tuple[int, dict[str, Any]]:
    """A non-streamed answer's status and JSON body."""
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)
    return response.status, json.loads(response.body)


def leg_timeout(
    total: float | None = None, sock_read: float | None = None
) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total, sock_read=sock_read, sock_connect=CONNECT_TIMEOUT_S)
