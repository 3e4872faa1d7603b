"""The side channel: a small ZMQ request/reply server per engine, and its client.

The server faces whatever can reach its port, so nothing a peer sends may stop it: bad frames
are answered with an ErrorReply where the envelope allows a reply, and dropped otherwise.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

import zmq

from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol import wire
from vllm_qaic_connector.protocol.ticket import RemotePrefill
from vllm_qaic_connector.protocol.wire import Message

Handler = Callable[[Message], Message]
# Inside vLLM's logger tree (printed in an engine) without importing vLLM: the proxy uses
# this module too.
logger = get_logger(__name__)

MAX_MESSAGE_BYTES = 1 << 20  # requests are small; libzmq drops a peer that sends more
MAX_REPLY_BYTES = 64 << 20  # handshake replies carry NIXL agent metadata
SEND_TIMEOUT_MS = 1000
COMPLAIN_EVERY_S = 10.0
MAX_AGE_S = 30.0  # with a key, frames sent longer ago (or later) than this are refused


def endpoint(host: str, port: int | None = None) -> str:
    """ZMQ's address of ``host`` (a name, IPv4, or IPv6 with or without brackets): libzmq
    wants an IPv6 literal bracketed (and ``zmq.IPV6`` on). Only IPv6 literals hold colons."""
    host = host.strip("[]")
    return f"tcp://{f'[{host}]' if ':' in host else host}" + (f":{port}" if port else "")


def _socket(ctx: zmq.Context, kind: int, options: dict[zmq.SocketOption, int]) -> zmq.Socket:
    sock = ctx.socket(kind)
    # IPV6: else libzmq refuses IPv6 addresses (and v6-only names).
    for option, value in {zmq.LINGER: 0, zmq.IPV6: 1, **options}.items():
        sock.setsockopt(option, value)
    return sock


class ReplayGuard:
    """Remembers the nonces of the last MAX_AGE_S: a frame is accepted once, while fresh."""

    def __init__(self) -> None:
        self._seen: dict[bytes, float] = {}  # nonce -> when it expires from memory

    def problem(self, nonce: bytes, sent_at: float) -> str | None:
        now = time.time()
        if abs(now - sent_at) > MAX_AGE_S:
            return (
                f"stale message: sent {now - sent_at:+.1f}s from now, more than "
                f"{MAX_AGE_S:.0f}s (peers' clocks must agree)"
            )
        while self._seen:  # insertion order is expiry order
            oldest, until = next(iter(self._seen.items()))
            if until > now:
                break
            del self._seen[oldest]
        if nonce in self._seen:
            return "replayed message: its nonce was seen before"
        self._seen[nonce] = now + 2 * MAX_AGE_S
        return None


class SideChannelTimeout(ConnectionError, TimeoutError):
    """The peer did not answer in time (it may be busy, or gone)."""


class SideChannelServer:
    """Serves handshake and release messages on a daemon thread."""

    def __init__(self, host: str, port: int, handler: Handler, key: bytes | None) -> None:
        self._ctx = zmq.Context()
        options = {zmq.MAXMSGSIZE: MAX_MESSAGE_BYTES, zmq.SNDTIMEO: SEND_TIMEOUT_MS}
        self._sock = _socket(self._ctx, zmq.ROUTER, options)
        try:
            if port:
                self._sock.bind(endpoint(host, port))
            self.port = port or self._sock.bind_to_random_port(endpoint(host))
        except zmq.ZMQError:
            self._sock.close(0)
            self._ctx.term()
            raise
        self._handler, self._key = handler, key
        self._replays = ReplayGuard()  # only this thread touches it
        self._complained_at, self._quiet = -COMPLAIN_EVERY_S, 0  # see _complain
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="qaic-side-channel", daemon=True)
        self._thread.start()

    def _complain(self, fmt: str, *args: object) -> None:
        """One warning per interval, the rest at debug: a flood of garbage must not flood the
        log. Only the serving thread complains."""
        now = time.monotonic()
        if now - self._complained_at < COMPLAIN_EVERY_S:
            self._quiet += 1
            logger.debug("QAICConnector side channel: " + fmt, *args)
            return
        suffix = f" ({self._quiet} similar since the last warning)" if self._quiet else ""
        logger.warning("QAICConnector side channel: " + fmt + suffix, *args)
        self._complained_at, self._quiet = now, 0

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if self._sock.poll(100):
                        self._serve_one()
                except Exception as exc:  # nothing a peer does may end the loop
                    self._complain("%s: %s", type(exc).__name__, exc)
                    time.sleep(0.01)  # a persistent socket error must not spin a core
        finally:
            self._sock.close(0)  # the socket is only ever touched by this thread

    def _serve_one(self) -> None:
        frames = self._sock.recv_multipart(zmq.NOBLOCK)
        # A REQ peer's envelope is [identity, b"", payload]; without the empty delimiter
        # there is no way to address a reply a REQ socket would accept.
        if len(frames) < 3 or frames[1] != b"":
            self._complain("dropped a message of %d frames without a REQ envelope", len(frames))
            return
        reply: Message
        nonce = b""
        try:
            if len(frames) != 3:
                raise ValueError(f"expected one payload frame, got {len(frames) - 2}")
            envelope = wire.open_message(frames[2], self._key)
            nonce = envelope.nonce
            # Without a key anyone can forge a fresh frame anyway.
            if self._key and (replayed := self._replays.problem(nonce, envelope.sent_at)):
                raise ValueError(replayed)
        except ValueError as exc:
            reply = wire.ErrorReply(str(exc))
            self._complain("refused a message: %s", exc)
        else:
            try:
                reply = self._handler(envelope.message)
            except Exception as exc:  # a peer may provoke this at will: complain, rate-limited
                self._complain("handler failed on %s: %r", type(envelope.message).__name__, exc)
                reply = wire.ErrorReply(str(exc) or type(exc).__name__)
        frame = wire.encode_message(reply, self._key, in_reply_to=nonce)
        try:
            self._sock.send_multipart([frames[0], b"", frame], zmq.NOBLOCK)
        except zmq.Again:
            self._complain("dropped a reply: the peer is not reading")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if not self._thread.is_alive():  # else a stuck handler still owns the socket
            self._ctx.term()


def call(host: str, port: int, msg: Message, key: bytes | None, timeout_s: float) -> Message:
    """One request/reply round trip. Raises ConnectionError on timeout, a malformed address
    or reply, or an error reply (SideChannelTimeout, a ConnectionError, on timeout)."""
    ms = int(timeout_s * 1000)
    options = {zmq.MAXMSGSIZE: MAX_REPLY_BYTES, zmq.RCVTIMEO: ms, zmq.SNDTIMEO: ms}
    sock = _socket(zmq.Context.instance(), zmq.REQ, options)
    nonce = secrets.token_bytes(wire.NONCE_BYTES)
    try:
        sock.connect(endpoint(host, port))
        sock.send(wire.encode_message(msg, key, nonce=nonce))
        envelope = wire.open_message(sock.recv(), key)
        if key and envelope.in_reply_to != nonce:  # a replayed, or someone else's, reply
            raise ValueError("the reply does not answer our request")
        reply = envelope.message
    except zmq.Again:
        raise SideChannelTimeout(f"side channel {host}:{port} silent for {timeout_s}s") from None
    # An unauthenticated or malformed reply, or e.g. an address libzmq cannot parse.
    except (ValueError, zmq.ZMQError) as exc:
        raise ConnectionError(f"side channel {host}:{port}: {exc}") from None
    finally:
        sock.close(0)
    if isinstance(reply, wire.ErrorReply):
        raise ConnectionError(f"side channel {host}:{port} refused: {reply.message}")
    return reply


def release(
    remote: RemotePrefill, key: bytes | None, timeout_s: float, reader: tuple[int, int] = (0, 1)
) -> None:
    """Tells the prefill that ``remote``'s staging is no longer wanted here (read, refused
    or abandoned by the decode rank ``reader``: its rank and TP size), so it frees it now
    rather than at the lease's end. A prefill that cannot be reached is logged: its lease
    frees the staging."""
    msg = wire.ReleaseRequest([remote.remote_request_id], *reader)
    try:
        call(remote.remote_host, remote.remote_port, msg, key, timeout_s)
    except ConnectionError as exc:
        logger.warning(
            "QAICConnector: could not release staging of %s at %s:%d (its lease will): %s",
            remote.remote_request_id, remote.remote_host, remote.remote_port, exc,
        )  # fmt: skip
