"""The disaggregation proxy: a front door over prefill and decode engines that serves vLLM's
API (OpenAI's completions, chat and Responses, Anthropic's Messages; `apis`).

Each request is prefilled with one token and ``do_remote_decode`` (never streamed), then
decoded with the ``kv_transfer_params`` the prefill returned; the decode's answer (or its
server-sent events, as they come) goes to the client. Where the decode can continue from the
prefill's token, that token is the client's first (`first_token`). A failed leg is a JSON
error naming it: 503 unreachable, 504 timed out, 502 a bad answer. When the decode leg fails
or the client goes away, the prefill is told to release the staged KV at once. The routes
that one engine answers (tokenize, embeddings...) are relayed to a decode.

    vllm-qaic-proxy --prefill URL [URL...] --decode URL [URL...] [--decode-kv HOST:PORT ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.keys import KEY_ENV, load_key
from vllm_qaic_connector.protocol.wire import ReleaseRequest, parse_remote_prefill
from vllm_qaic_proxy import apis, batches, first_token
from vllm_qaic_proxy.apis import Api
from vllm_qaic_proxy.first_token import FirstToken
from vllm_qaic_proxy.routing import LeastOutstanding, Router

logger = logging.getLogger(__name__)  # its own program's, not inside vLLM
T = TypeVar("T")
Sink = web.StreamResponse | batches.Part  # where a stream's events go

ERROR_TYPES = {
    404: "NotFoundError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout",
}  # fmt: skip
# No limit on a leg's time unless the operator sets one: vLLM's server has none, and a long
# answer not streamed (a reasoning model's 30k tokens) takes as long as it takes. A backend
# that accepts no connection in this long is down, and another is tried.
CONNECT_TIMEOUT_S = 10.0
# What a relayed route passes on of the client's request and of the decode's answer.
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
RELAYED_HEADERS = (*FORWARDED_HEADERS, "Content-Type", "Accept")
# Under vLLM's keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a pooled connection is never
# reused just as the engine's server closes it (the request would fail to send).
BACKEND_KEEPALIVE_S = 4.0
# vLLM's server takes a request of any size; aiohttp's default (1 MiB) refused a long
# context's prompt (~7 bytes a token id, ~4 a token of text) with a bare 413.
MAX_REQUEST_BYTES = 1 << 30
# A client that goes away cancels its handler, which closes the legs' connections: the
# engines abort the request, as vLLM's own server does (not only a stream's, on write).
HANDLER_CANCELLATION = True


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


def held(stored: bool, leg: Callable[[str], Awaitable[T]]) -> Callable[[str], Awaitable[T]]:
    """``leg``, where a ``stored`` response's 404 is NotHere: another backend may hold it."""
    if not stored:
        return leg

    async def call(url: str) -> T:
        try:
            return await leg(url)
        except LegError as exc:
            if exc.status != 404 or isinstance(exc, NoAnswer):
                raise
            raise NotHere(404, f"{url} does not hold it", exc.body) from None

    return call


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """vLLM's (and OpenAI's) error shape."""
    kind = kind or ERROR_TYPES.get(status, "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class Proxy:
    def __init__(
        self,
        prefills: list[str],
        decodes: list[str],
        decode_kv: list[str] | None = None,
        *,
        routing: str = "least-outstanding",
        prefill_timeout_s: float | None = None,
        decode_timeout_s: float | None = None,
        key: bytes | None = None,
        first_token_from_prefill: bool = True,
    ) -> None:
        self.router = Router(prefills, decodes, routing)
        self._decode_kv = dict(zip(decodes, decode_kv or [""] * len(decodes), strict=True))
        self.prefill_timeout_s, self.decode_timeout_s = prefill_timeout_s, decode_timeout_s
        self._key, self._first_from_prefill = key, first_token_from_prefill
        self._session: aiohttp.ClientSession | None = None
        self._releases: set[asyncio.Future[None]] = set()
        self._contexts: dict[str, int | None] = {}  # each decode's max_model_len

    # --- legs -----------------------------------------------------------------------------

    async def _open(
        self,
        leg: str,
        url: str,
        body: dict[str, Any],
        timeout: aiohttp.ClientTimeout,
        auth: dict[str, str],
    ) -> aiohttp.ClientResponse:
        assert self._session is not None
        try:
            return await self._session.post(url, json=body, timeout=timeout, headers=auth)
        except UNANSWERED as exc:
            raise NoAnswer(
                503, f"{leg} leg {url} is unreachable: {exc or 'no connection'}"
            ) from None
        except asyncio.TimeoutError:
            raise LegError(504, f"{leg} leg {url} timed out") from None
        except aiohttp.ClientError as exc:
            raise LegError(503, f"{leg} leg {url} is unreachable: {exc}") from None

    async def _json(self, leg: str, url: str, resp: aiohttp.ClientResponse) -> dict[str, Any]:
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

    async def _failover(
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

    async def _prefill(
        self, url: str, body: dict[str, Any], auth: dict[str, str]
    ) -> dict[str, Any]:
        timeout = leg_timeout(total=self.prefill_timeout_s)
        resp = await self._open("prefill", url, body, timeout, auth)
        return await self._json("prefill", url, resp)

    def _release(self, params: dict[str, Any]) -> None:
        """Free the prefill's staging now rather than at lease end (in the background)."""
        try:
            remote = parse_remote_prefill(params)
        except ValueError:
            return

        def call() -> None:
            msg = ReleaseRequest([remote.remote_request_id])
            try:
                side_channel.call(remote.remote_host, remote.remote_port, msg, self._key, 5.0)
            except ConnectionError as exc:
                logger.warning("could not release %s (its lease will): %s", remote, exc)

        task = asyncio.get_running_loop().run_in_executor(None, call)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _stream(
        self,
        request: web.Request,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str],
        first: FirstToken | None,
        leg: str = "decode",
        sink: Sink | None = None,
    ) -> tuple[web.StreamResponse, bool]:
        """The decode's events through as they come (after ``first``'s, once the decode
        has taken the request), to the client or into ``sink``; False when the client went
        away. Then the decode's connection is closed, which aborts the request there."""
        timeout = leg_timeout(sock_read=self.decode_timeout_s)
        resp = await self._open(leg, url, body, timeout, credentials(request))
        if resp.status != 200 or "json" in resp.content_type:
            await self._json(leg, url, resp)  # raises: a stream answers 200 with events
            raise LegError(502, f"{leg} leg {url} answered a stream request with JSON")
        headers["Content-Type"] = resp.headers.get("Content-Type", "")
        out: Sink = sink or web.StreamResponse(headers=headers)
        try:
            await out.prepare(request)
            if first is not None:  # any usage after it (asked, or forced) counts it as answer
                await out.write(first.events(body.get("stream_options"), final_usage=False))
                async for line in resp.content:
                    await out.write(first_token.fix_event(line))
            else:
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
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

    # --- endpoints ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = None
        with contextlib.suppress(ValueError):
            body = await request.json()
        if not isinstance(body, dict):
            return web.json_response(error_body(400, "the body must be a JSON object"), status=400)
        api = apis.GENERATING[request.path]
        several = batches.prompts(body) if api is apis.COMPLETIONS else None
        if several is None:
            return await self._handoff(request, body, api)
        if body.get("stream"):
            return await self._streamed_list(request, body, api, several)
        answers = await asyncio.gather(
            *(self._handoff(request, {**body, "prompt": p}, api) for p in several)
        )
        status, answer = batches.merged([answer_of(a) for a in answers])
        timings = [t for a in answers if (t := a.headers.get("Server-Timing"))]
        timing = {"Server-Timing": max(timings, key=prefill_ms)} if timings else None
        return web.json_response(answer, status=status, headers=timing)

    async def _streamed_list(
        self, request: web.Request, body: dict[str, Any], api: Api, several: list[Any]
    ) -> web.StreamResponse:
        """Each prompt's handoff streamed into one stream, as vLLM streams a list; when
        every prompt failed before the stream opened, the first failure as JSON."""
        n = body.get("n")
        merged = batches.StreamedList(request, n if isinstance(n, int) else 1)
        answers = await asyncio.gather(
            *(
                self._handoff(request, {**body, "prompt": p}, api, merged.part(i))
                for i, p in enumerate(several)
            )
        )
        failures = [answer_of(a) for a in answers if isinstance(a, web.Response)]
        if failures and not merged.out.prepared:
            return web.json_response(failures[0][1], status=failures[0][0])
        return await merged.finish(failures)

    async def _handoff(
        self, request: web.Request, body: dict[str, Any], api: Api, sink: Sink | None = None
    ) -> web.StreamResponse:
        """One prompt through a prefill leg and a decode leg; the decode leg alone where a
        prefill leg would be wasted or refused (`apis.answers_alone`). A stream goes to the
        client, or into ``sink`` (a part of a streamed list)."""
        prefill_url, decode_url = self.router.route()
        auth = credentials(request)
        first_from_prefill = (
            self._first_from_prefill
            and api.first_token_from_prefill
            and first_token.eligible(body, chat=False)
        )
        params: dict[str, Any] | None = None
        first: FirstToken | None = None
        timing: dict[str, str] = {}
        done = False
        alone = apis.answers_alone(body, api)
        try:
            if alone is None:
                started = time.monotonic()
                to_prefill = api.prefill_body(body, self._decode_kv[decode_url])
                if first_from_prefill:
                    to_prefill["return_token_ids"] = True
                try:
                    prefilled = await self._failover(
                        self.router.prefills,
                        prefill_url,
                        lambda url: self._prefill(url + request.path, to_prefill, auth),
                    )
                except LegError as exc:
                    if exc.body is not None:  # the prefill's own 4xx: the client's to fix
                        raise
                    # No prefill served it (all down, or failing): the decode computes the
                    # prompt itself, slower but answered, as llm-d's sidecar falls back.
                    logger.warning("%s; the decode computes the prompt itself", exc)
                    prefilled = {}
                # The prefill leg's share of TTFT, for clients to see (W3C Server-Timing).
                took_ms = (time.monotonic() - started) * 1e3
                timing = {"Server-Timing": f"prefill;dur={took_ms:.1f}"}
                params = prefilled.get("kv_transfer_params")
                if isinstance(params, dict) and params.get("error"):
                    # Not handed off (e.g. staging full): the decode gets the error, and its
                    # kv_load_failure_policy decides, as behind any router.
                    logger.warning("prefill %s did not hand off: %s", prefill_url, params["error"])
                elif first_from_prefill:
                    context = await self._context(decode_url, auth)
                    first = FirstToken.of(prefilled, body, context)
                if first is not None and first.finished:  # the prefill's token was the answer
                    return await self._prefill_only(request, body, first, timing, sink)
            if first is not None:
                to_decode = first.decode_body(body, params or {})
            else:
                to_decode = {**body, "kv_transfer_params": params} if params else body
            stored = alone == "previous_response_id"
            try:
                response, done = await self._answer(
                    request, "decode", decode_url, to_decode, first, timing, stored, sink
                )
            except NotHere:
                raise  # no decode holds the earlier response: its 404 is the answer
            except NoAnswer as exc:
                # No decode took it: a prefill answers it whole (its prefix cache holds the
                # prompt by now), and the staged KV is released.
                logger.warning("%s; a prefill answers the whole request", exc)
                response, _ = await self._answer(
                    request, "prefill", prefill_url, body, None, {}, sink=sink
                )
            return response
        except LegError as exc:
            return exc.response()
        finally:
            if not done and isinstance(params, dict):
                self._release(params)

    async def _answer(
        self,
        request: web.Request,
        leg: str,
        url: str,
        body: dict[str, Any],
        first: FirstToken | None,
        timing: dict[str, str],
        stored: bool = False,
        sink: Sink | None = None,
    ) -> tuple[web.StreamResponse, bool]:
        """The client's answer from ``url`` or another backend of its kind (streamed as it
        comes, or whole, with the ``timing`` header), and whether it was all sent. ``stored``:
        the request continues a stored response, which one decode holds (the others 404)."""
        pool = self.router.decodes if leg == "decode" else self.router.prefills
        if body.get("stream"):
            return await self._failover(
                pool,
                url,
                held(
                    stored,
                    lambda u: self._stream(
                        request, u + request.path, body, timing, first, leg, sink
                    ),
                ),
            )
        auth = credentials(request)
        answer = await self._failover(
            pool, url, held(stored, lambda u: self._whole(u, request.path, body, auth, leg))
        )
        return web.json_response(first.joined(answer) if first else answer, headers=timing), True

    async def _context(self, decode_url: str, auth: dict[str, str]) -> int | None:
        """The decode's max_model_len, from its /v1/models once; None where it names none
        (a decode without that route, the QAIC emulator's, is not asked again; one that did
        not answer, or refused the client's credentials, is)."""
        if decode_url not in self._contexts:
            assert self._session is not None
            timeout = aiohttp.ClientTimeout(total=5)
            url = decode_url + "/v1/models"
            try:
                async with self._session.get(url, timeout=timeout, headers=auth) as resp:
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

    async def _whole(
        self, url: str, path: str, body: dict[str, Any], auth: dict[str, str], leg: str
    ) -> dict[str, Any]:
        """A leg's whole answer, not streamed."""
        timeout = leg_timeout(total=self.decode_timeout_s)
        resp = await self._open(leg, url + path, body, timeout, auth)
        return await self._json(leg, url, resp)

    async def _prefill_only(
        self,
        request: web.Request,
        body: dict[str, Any],
        first: FirstToken,
        timing: dict[str, str],
        sink: Sink | None = None,
    ) -> web.StreamResponse:
        """The answer when it ends at the prefill's token (its staging is released)."""
        if not body.get("stream"):
            return web.json_response(first.answer, headers=timing)
        out: Sink = sink or web.StreamResponse(
            headers={**timing, "Content-Type": "text/event-stream"}
        )
        with contextlib.suppress(ConnectionResetError):
            await out.prepare(request)
            await out.write(first.events(body.get("stream_options")))
            await out.write_eof()
        return response_of(out)

    async def models(self, request: web.Request) -> web.Response:
        assert self._session is not None
        url = self.router.decodes.pick() + "/v1/models"
        timeout, auth = aiohttp.ClientTimeout(total=10), credentials(request)
        try:
            async with self._session.get(url, timeout=timeout, headers=auth) as resp:
                return web.json_response(await resp.json(content_type=None), status=resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            return web.json_response(error_body(503, f"decode {url}: {exc}"), status=503)

    async def relay(self, request: web.Request) -> web.StreamResponse:
        """A route that one engine answers, from a decode, streamed through as it comes. A
        stored response (Responses API) from whichever decode holds it."""
        if not apis.relayed(request.path):
            problem = (
                f"{request.method} {request.path} acts on or reports one engine: send it to "
                "each engine, not through the disaggregating proxy"
            )
            return web.json_response(error_body(404, problem), status=404)
        data = await request.read()
        headers = {k: v for k in RELAYED_HEADERS if (v := request.headers.get(k)) is not None}
        stored = request.path.startswith("/v1/responses/")  # one decode holds it, others 404
        pool = self.router.decodes
        try:
            return await self._failover(
                pool,
                pool.pick(),
                held(stored, lambda u: self._relay(request, u, data, headers, stored)),
            )
        except LegError as exc:
            return exc.response()

    async def _relay(
        self, request: web.Request, url: str, data: bytes, headers: dict[str, str], stored: bool
    ) -> web.StreamResponse:
        """``url``'s answer to the client's request, streamed back; a 404 for a ``stored``
        response is raised (`held`: another decode may hold it)."""
        assert self._session is not None
        target = url + request.path_qs
        try:
            resp = await self._session.request(
                request.method, target, data=data, headers=headers, timeout=leg_timeout()
            )
        except UNANSWERED as exc:
            raise NoAnswer(
                503, f"decode {target} is unreachable: {exc or 'no connection'}"
            ) from None
        except aiohttp.ClientError as exc:
            raise LegError(503, f"decode {target} is unreachable: {exc}") from None
        try:
            if resp.status == 404 and stored:
                missing = None
                with contextlib.suppress(ValueError, aiohttp.ClientError):
                    missing = await resp.json(content_type=None)
                raise LegError(404, f"decode {url}: HTTP 404", missing)
            kept = {k: v for k in ("Content-Type",) if (v := resp.headers.get(k)) is not None}
            out = web.StreamResponse(status=resp.status, headers=kept)
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
            return out
        finally:
            resp.close()

    async def _backend_health(self, url: str) -> str:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=3)
            async with self._session.get(url + "/health", timeout=timeout) as resp:
                return "ok" if resp.status == 200 else f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"unreachable: {exc or type(exc).__name__}"

    async def health(self, _: web.Request) -> web.Response:
        """200 while a decode answers its /health: the proxy serves (with no prefill up,
        slower: ``degraded``, the decodes computing the prompts)."""
        report: dict[str, dict[str, str]] = {}
        for role, pool in (("prefill", self.router.prefills), ("decode", self.router.decodes)):
            urls = list(pool.outstanding)
            states = await asyncio.gather(*(self._backend_health(u) for u in urls))
            report[role] = dict(zip(urls, states, strict=True))
        ok = "ok" in report["decode"].values()
        degraded = "ok" not in report["prefill"].values()
        body = {"ok": ok, "degraded": degraded, **report}
        return web.json_response(body, status=200 if ok else 503)

    async def _start(self, _: web.Application) -> None:
        # No cap on connections (aiohttp's is 100, and a stream holds one to its end: the
        # 101st request waited for one to end); the engines queue, as behind vLLM's router.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=BACKEND_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector)

    async def _stop(self, _: web.Application) -> None:
        if self._releases:
            await asyncio.wait(self._releases, timeout=6)
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        for path in apis.GENERATING:
            app.router.add_post(path, self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/{path:.*}", self.relay)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app


def credentials(request: web.Request) -> dict[str, str]:
    """The client's headers that the legs carry: its credentials, for the backends to check
    (``vllm serve --api-key``), and its request id, which vLLM takes as the request's own (so
    both legs' logs name the client's id, as behind llm-d's sidecar)."""
    return {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}


def response_of(out: Sink) -> web.StreamResponse:
    """The client's response that ``out`` writes to."""
    return out.response if isinstance(out, batches.Part) else out


def answer_of(response: web.StreamResponse) -> tuple[int, dict[str, Any]]:
    """A non-streamed answer's status and JSON body."""
    assert isinstance(response, web.Response) and isinstance(response.body, bytes)
    return response.status, json.loads(response.body)


def prefill_ms(timing: str) -> float:
    """The prefill leg's milliseconds in our Server-Timing header."""
    return float(timing.rpartition("dur=")[2] or 0)


def leg_timeout(
    total: float | None = None, sock_read: float | None = None
) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total, sock_read=sock_read, sock_connect=CONNECT_TIMEOUT_S)


# No answer at all: no connection, or closed before its headers (another backend may serve).
UNANSWERED = (
    aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ConnectionTimeoutError,
)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser("vllm-qaic-proxy", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--prefill", nargs="+", required=True, help="prefill base URLs")
    add("--decode", nargs="+", required=True, help="decode base URLs")
    add("--decode-kv", nargs="+", default=None,
        help="HOST:PORT of each decode's side channel (its side_channel_port), "
        "so prefills stage in the decode's layout")  # fmt: skip
    add("--routing", choices=Router.MODES, default="least-outstanding",
        help="least-outstanding: each leg to the backend with the fewest requests in flight; "
        "pairs: round-robin over every (prefill, decode) pair")  # fmt: skip
    add("--prefill-timeout-s", type=float, default=None,
        help="whole prefill leg (default: no limit, as vLLM's server sets none)")  # fmt: skip
    add("--decode-timeout-s", type=float, default=None,
        help="whole decode leg; when streaming, the longest gap between events "
        "(default: no limit)")  # fmt: skip
    add("--side-channel-key-file", default=None,
        help=f"the prefills' side-channel key, to release early (else ${KEY_ENV})")  # fmt: skip
    add("--first-token", choices=("prefill", "decode"), default="prefill",
        help="prefill: where the decode can continue from it, the prefill's token is "
        "the client's first; decode: the decode's is, as in vLLM's toy proxy")  # fmt: skip
    add("--host", default="127.0.0.1",
        help="as vLLM's --host: '::' takes IPv6 and IPv4 clients")  # fmt: skip
    add("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    if args.decode_kv and len(args.decode_kv) != len(args.decode):
        parser.error("--decode-kv needs one HOST:PORT per --decode URL")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    proxy = Proxy(
        [u.rstrip("/") for u in args.prefill],
        [u.rstrip("/") for u in args.decode],
        args.decode_kv,
        routing=args.routing,
        prefill_timeout_s=args.prefill_timeout_s,
        decode_timeout_s=args.decode_timeout_s,
        key=load_key(args.side_channel_key_file),
        first_token_from_prefill=args.first_token == "prefill",
    )
    web.run_app(
        proxy.app(), host=listen_hosts(args.host), port=args.port, print=None, loop=_event_loop(),
        handler_cancellation=HANDLER_CANCELLATION,
    )  # fmt: skip


def listen_hosts(host: str) -> list[str]:
    """Where to listen. asyncio makes an IPv6 listener v6-only, where vLLM's (uvicorn's) on
    '::' also takes IPv4 clients: '::' listens on both, as vLLM does."""
    return [host, "0.0.0.0"] if host.strip("[]") == "::" else [host.strip("[]")]


def _event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (vLLM's API server runs on it too): the proxy relays every
    streamed chunk, and on uvloop each costs it less CPU than on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


if __name__ == "__main__":
    main()
