"""A minimal disaggregation proxy: prefill with ``max_tokens=1`` and ``do_remote_decode``,
then decode with the ``kv_transfer_params`` the prefill returned. Round-robin over
every (prefill, decode) pair, so each decode reads from each prefill.
Run: ``vllm-qaic-proxy --prefill URL [URL...] --decode URL [URL...]``."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web

PREFILL_OVERRIDES: dict[str, Any] = {"max_tokens": 1, "stream": False, "min_tokens": 0}


class Proxy:
    def __init__(
        self, prefills: list[str], decodes: list[str], decode_kv: list[str] | None = None
    ) -> None:
        # Each decode optionally paired with its side channel, so the prefill can stage
        # straight into that decode's layout.
        decode_targets = list(zip(decodes, decode_kv or [""] * len(decodes), strict=True))
        self._routes: Iterator[tuple[str, tuple[str, str]]] = itertools.cycle(
            list(itertools.product(prefills, decode_targets))
        )
        self._session: aiohttp.ClientSession | None = None

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        assert self._session is not None
        async with self._session.post(url, json=body) as resp:
            return resp.status, await resp.json(content_type=None)

    async def completions(self, request: web.Request) -> web.Response:
        path = request.path
        body = await request.json()
        prefill_url, (decode_url, decode_kv) = next(self._routes)
        params: dict[str, Any] = {"do_remote_decode": True}
        if decode_kv:
            host, port = decode_kv.rsplit(":", 1)
            params.update(decode_host=host, decode_port=int(port))
        prefill_body = {**body, **PREFILL_OVERRIDES, "kv_transfer_params": params}
        prefill_body.pop("stream_options", None)
        status, prefill = await self._post(prefill_url + path, prefill_body)
        if status != 200:
            return web.json_response(prefill, status=status)
        returned = prefill.get("kv_transfer_params")
        if returned and returned.get("error"):
            # The prefill could not hand this request off (e.g. staging full): say so.
            return web.json_response(
                {"error": {"message": returned["error"], "type": "KVHandoffError"}}, status=503
            )
        decode_body = dict(body)
        if returned:
            decode_body["kv_transfer_params"] = returned
        status, decoded = await self._post(decode_url + path, decode_body)
        return web.json_response(decoded, status=status)

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _start(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))

    async def _stop(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill base URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode base URLs")
    parser.add_argument(
        "--decode-kv",
        nargs="+",
        default=None,
        help="HOST:PORT of each decode's side channel (its side_channel_port), "
        "so prefills stage in the decode's layout",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    if args.decode_kv and len(args.decode_kv) != len(args.decode):
        parser.error("--decode-kv needs one HOST:PORT per --decode URL")
    proxy = Proxy(
        [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode], args.decode_kv
    )
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
