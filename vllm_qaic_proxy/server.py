"""The disaggregation proxy: a front door over prefill and decode engines that serves vLLM's
API (OpenAI's completions, chat and Responses, Anthropic's Messages; `apis`).

Each request is prefilled with one token and ``do_remote_decode`` (never streamed), then
decoded with the ``kv_transfer_params`` the prefill returned; the decode's answer (or its
server-sent events, as they come) goes to the client. Where the decode can continue from the
prefill's token, that token is the client's first (`first_token`). A failed leg is a JSON
error naming it: 503 unreachable, 504 timed out, 502 a bad answer. When the decode leg fails
or the client goes away, the prefill is told to release the staged KV at once. The routes
that one engine answers (tokenize, embeddings...) are relayed to a decode. Tickets stay
between the proxy and the engines: none from a client reaches an engine, none from an
engine reaches a client (`apis.from_client`).

    vllm-qaic-proxy --prefill URL [URL...] --decode URL [URL...] [--decode-kv HOST:PORT ...]
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from vllm_qaic_proxy import apis, first_token, prompt_lists, turns
from vllm_qaic_proxy.apis import Api
from vllm_qaic_proxy.first_token import FirstToken
from vllm_qaic_proxy.legs import (
    RELAYED_HEADERS,
    LegError,
    Legs,
    NoAnswer,
    NotHere,
    Sink,
    answer_of,
    credentials,
    error_body,
    response_of,
)
from vllm_qaic_proxy.routing import Router
from vllm_qaic_proxy.turns import Turns

logger = logging.getLogger(__name__)  # its own program's, not inside vLLM

# vLLM's server takes a request of any size; aiohttp's default (1 MiB) refused a long
# context's prompt (~7 bytes a token id, ~4 a token of text) with a bare 413.
MAX_REQUEST_BYTES = 1 << 30
# A client that goes away cancels its handler, which closes the legs' connections: the
# engines abort the request, as vLLM's own server does (not only a stream's, on write).
HANDLER_CANCELLATION = True


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
        reuse_turns: bool = False,
    ) -> None:
        self.router = Router(prefills, decodes, routing)
        self._decode_kv = dict(zip(decodes, decode_kv or [""] * len(decodes), strict=True))
        self._first_from_prefill = first_token_from_prefill
        self.legs = Legs(prefill_timeout_s, decode_timeout_s, key)
        self.turns = Turns(self.legs.release, reuse_turns, self.router.decodes.is_down)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = None
        with contextlib.suppress(ValueError):
            body = await request.json()
        if not isinstance(body, dict):
            return web.json_response(error_body(400, "the body must be a JSON object"), status=400)
        body = apis.from_client(body)
        api = apis.GENERATING[request.path]
        several = prompt_lists.prompts(body) if api is apis.COMPLETIONS else None
        if several is None:
            return await self._handoff(request, body, api)
        # Streamed, each prompt's handoff streams into one stream, as vLLM streams a list.
        streamed = prompt_lists.StreamedList(request, body.get("n")) if body.get("stream") else None
        parts = [streamed.part(i) if streamed else None for i in range(len(several))]
        handoffs = (
            self._handoff(request, {**body, "prompt": p}, api, part)
            for p, part in zip(several, parts, strict=True)
        )
        answers = await asyncio.gather(*handoffs)
        if streamed is not None:  # every prompt failed before the stream opened: the first
            failures = [answer_of(a) for a in answers if isinstance(a, web.Response)]
            if failures and not streamed.out.prepared:
                return web.json_response(failures[0][1], status=failures[0][0])
            return await streamed.finish(failures)
        status, answer = prompt_lists.merged([answer_of(a) for a in answers])
        timings = [t for a in answers if (t := a.headers.get("Server-Timing"))]
        timing = {"Server-Timing": max(timings, key=prefill_ms)} if timings else None
        return web.json_response(answer, status=status, headers=timing)

    async def _handoff(
        self, request: web.Request, body: dict[str, Any], api: Api, sink: Sink | None = None
    ) -> web.StreamResponse:
        """One prompt through a prefill leg and a decode leg; the decode leg alone where a
        prefill leg would be wasted or refused (`apis.answers_alone`). A stream goes to the
        client, or into ``sink`` (a part of a streamed list)."""
        prefill_url, decode_url = self.router.route()
        auth = credentials(request)
        client = turns.client(auth, request.remote)
        wanted = self._first_from_prefill and api.first_token_from_prefill
        first_from_prefill = wanted and first_token.eligible(body)
        params: dict[str, Any] | None = None
        refusal: LegError | None = None  # the prefill's 4xx
        first: FirstToken | None = None
        timing: dict[str, str] = {}
        done = False
        alone = apis.answers_alone(body, api)
        try:
            if alone is None:
                prefilled, timing, refusal = await self._prefill_leg(
                    request, body, api, (prefill_url, decode_url), client, first_from_prefill
                )
                params = prefilled.get("kv_transfer_params")
                if isinstance(params, dict) and params.get("error"):
                    # Not handed off (e.g. staging full): the decode gets the error, and its
                    # kv_load_failure_policy decides, as behind any router.
                    logger.warning("prefill %s did not hand off: %s", prefill_url, params["error"])
                elif first_from_prefill:
                    context = await self.legs.context(decode_url, auth)
                    first = FirstToken.of(prefilled, body, context)
                if first is not None and first.finished:  # the prefill's token was the answer
                    return await self._prefill_only(request, body, first, timing, sink)
            kept = None
            if keep := self.turns.asked(api, body, self._decode_kv[decode_url]):
                params = {**(params or {}), "keep_turn": True, "turn_id": keep}
                kept = functools.partial(self._kept, api, body, client, keep)
            to_decode = {**body, "kv_transfer_params": params} if params else body
            if first is not None:
                to_decode = first.decode_body(body, params or {})
            stored = alone == "previous_response_id"
            try:
                response, done = await self._answer(
                    request, "decode", decode_url, to_decode, first, timing, stored, sink, kept
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
            # A decode that cannot answer the request itself (a QAIC decode does not
            # prefill) leaves the prefill's refusal as the client's answer.
            return (refusal if refusal and exc.body is None else exc).response()
        finally:
            if not done and isinstance(params, dict):
                self.legs.release(params)

    async def _prefill_leg(
        self,
        request: web.Request,
        body: dict[str, Any],
        api: Api,
        route: tuple[str, str],
        client: str,
        with_token: bool,
    ) -> tuple[dict[str, Any], dict[str, str], LegError | None]:
        """The prefill leg of a request routed to ``route`` (prefill, decode): the prompt with
        one token and ``do_remote_decode`` (and the conversation's kept turn, where a decode
        kept it: `turns`); ``with_token``: its token ids, and what else the answer shows of
        it. Its answer, its share of TTFT for clients to see (W3C Server-Timing), and its
        refusal (4xx), if it refused."""
        started, (prefill_url, decode_url) = time.monotonic(), route
        to_prefill = api.prefill_body(body, self._decode_kv[decode_url])
        if with_token:
            asked = {k: body[k] for k in first_token.MERGED if k in body}
            to_prefill.update(asked, return_token_ids=True)
        if turn := self.turns.take(api, body, client):
            to_prefill["kv_transfer_params"]["earlier_turn"] = turn
        auth, refusal = credentials(request), None
        try:
            prefilled = await self.legs.failover(
                self.router.prefills,
                prefill_url,
                lambda url: self.legs.prefill(url + request.path, to_prefill, auth),
            )
        except LegError as exc:
            # No prefill served it (all down, or failing): the decode computes the prompt
            # itself, slower but answered, as llm-d's sidecar falls back. A prefill's refusal
            # (4xx) is of the prefill leg (one token, n = 1, not streamed): the decode answers
            # the request as vLLM alone would (another field named first; a stream's, an
            # error event).
            logger.warning("%s; the decode answers the request itself", exc)
            prefilled, refusal = {}, exc if exc.body is not None else None
        finally:
            if turn:  # loaded by now, or computed: the decode may free it
                self.legs.release(turn)
        took_ms = (time.monotonic() - started) * 1e3
        return prefilled, {"Server-Timing": f"prefill;dur={took_ms:.1f}"}, refusal

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
        kept: Callable[[str, Any], None] | None = None,
    ) -> tuple[web.StreamResponse, bool]:
        """The client's answer from ``url`` or another backend of its kind (streamed as it
        comes, or whole, with the ``timing`` header), and whether it was all sent. ``stored``:
        the request continues a stored response, which one decode holds (the others 404)."""
        pool = self.router.decodes if leg == "decode" else self.router.prefills

        async def call(u: str) -> tuple[web.StreamResponse, bool]:
            try:
                return await self.legs.answer(request, u, body, timing, first, leg, sink, kept)
            except LegError as exc:  # a stored response's 404: another decode may hold it
                if not stored or exc.status != 404 or isinstance(exc, NoAnswer):
                    raise
                raise NotHere(404, f"{u} does not hold it", exc.body) from None

        return await self.legs.failover(pool, url, call)

    def _kept(
        self, api: Api, body: dict[str, Any], client: str, name: str, url: str, ticket: Any
    ) -> None:
        """Keeps the turn that the decode at ``url`` (the one that answered) kept as ``name``:
        its ticket came with the answer, or, a stream carrying none, is asked of that decode's
        side channel in the background (with DP > 1, rank 0's: another rank's is not found)."""
        keep = functools.partial(self.turns.keep, api, body, client, decode=url)
        if ticket is None and body.get("stream"):
            self.legs.turn(self._decode_kv[url], name, keep)
        else:
            keep(ticket)

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

    async def relay(self, request: web.Request) -> web.StreamResponse:
        """A route that one engine answers, from a decode, streamed through as it comes. A
        stored response (Responses API) from whichever decode holds it."""
        if request.path in apis.ONE_ENGINE:
            problem = (
                f"{request.method} {request.path} acts on or reports one engine: send it to "
                "each engine, not through the disaggregating proxy"
            )
            return web.json_response(error_body(404, problem), status=404)
        data = apis.relayed(await request.read())
        relayed = {k: v for k in RELAYED_HEADERS if (v := request.headers.get(k)) is not None}
        headers = {**credentials(request), **relayed}
        stored = request.path.startswith("/v1/responses/")  # one decode holds it, others 404
        pool = self.router.decodes
        try:
            return await self.legs.failover(
                pool, pool.pick(), lambda u: self.legs.relay(request, u, data, headers, stored)
            )
        except LegError as exc:
            return exc.response()

    async def health(self, _: web.Request) -> web.Response:
        """200 while a decode answers its /health: the proxy serves (with no prefill up,
        slower: ``degraded``, the decodes computing the prompts)."""
        report: dict[str, dict[str, str]] = {}
        for role, pool in (("prefill", self.router.prefills), ("decode", self.router.decodes)):
            urls = list(pool.outstanding)
            states = await asyncio.gather(*(self.legs.health(u) for u in urls))
            report[role] = dict(zip(urls, states, strict=True))
        ok = "ok" in report["decode"].values()
        body = {"ok": ok, "degraded": "ok" not in report["prefill"].values(), **report}
        return web.json_response(body, status=200 if ok else 503)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        for path in apis.GENERATING:
            app.router.add_post(path, self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/{path:.*}", self.relay)
        app.on_startup.append(self.legs.start)
        app.on_cleanup.append(self.legs.stop)
        return app


def prefill_ms(timing: str) -> float:
    """The prefill leg's milliseconds in our Server-Timing header."""
    return float(timing.rpartition("dur=")[2] or 0)
