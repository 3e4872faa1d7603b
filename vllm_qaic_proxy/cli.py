"""`vllm-qaic-proxy`: the proxy's command line (`server.Proxy` on aiohttp)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from aiohttp import web

from vllm_qaic_connector.protocol.keys import KEY_ENV, load_key
from vllm_qaic_proxy import server
from vllm_qaic_proxy.routing import Router


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        "vllm-qaic-proxy", description=(server.__doc__ or "").splitlines()[0]
    )
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
    add("--reuse-turns", action="store_true",
        help="the decodes keep turns (reuse_turns): ask them to, and give each ticket to the "
        "prefill of the conversation's next turn")  # fmt: skip
    add("--host", default="127.0.0.1",
        help="as vLLM's --host: '::' takes IPv6 and IPv4 clients")  # fmt: skip
    add("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    if args.decode_kv and len(args.decode_kv) != len(args.decode):
        parser.error("--decode-kv needs one HOST:PORT per --decode URL")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    proxy = server.Proxy(
        [u.rstrip("/") for u in args.prefill],
        [u.rstrip("/") for u in args.decode],
        args.decode_kv,
        routing=args.routing,
        prefill_timeout_s=args.prefill_timeout_s,
        decode_timeout_s=args.decode_timeout_s,
        key=load_key(args.side_channel_key_file),
        first_token_from_prefill=args.first_token == "prefill",
        reuse_turns=args.reuse_turns,
    )
    web.run_app(
        proxy.app(), host=listen_hosts(args.host), port=args.port, print=None, loop=_event_loop(),
        handler_cancellation=server.HANDLER_CANCELLATION,
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
