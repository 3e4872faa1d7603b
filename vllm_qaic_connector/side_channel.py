"""The side channel: a small ZMQ request/reply server per engine, and its client."""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from vllm_qaic_connector.wire import ErrorReply, Message, decode_message, encode_message

Handler = Callable[[Message], Message]


class SideChannelTimeout(ConnectionError, TimeoutError):
    """The peer did not answer in time (it may be busy, or gone)."""


class SideChannelServer:
    """Serves handshake and release messages on a daemon thread."""

    def __init__(self, host: str, port: int, handler: Handler, key: bytes | None) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        addr = f"tcp://{host}"
        self.port = self._sock.bind_to_random_port(addr) if port == 0 else port
        if port:
            self._sock.bind(f"{addr}:{port}")
        self._handler = handler
        self._key = key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="qaic-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, _, frame = self._sock.recv_multipart()
            try:
                reply = self._handler(decode_message(frame, self._key))
            except Exception as exc:  # a bad peer must not kill the listener
                reply = ErrorReply(str(exc))
            self._sock.send_multipart([ident, b"", encode_message(reply, self._key)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._ctx.term()


def call(host: str, port: int, msg: Message, key: bytes | None, timeout_s: float) -> Message:
    """One request/reply round trip. Raises ConnectionError on timeout or an error reply."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(encode_message(msg, key))
        reply = decode_message(sock.recv(), key)
    except zmq.Again:
        raise SideChannelTimeout(f"side channel {host}:{port} silent for {timeout_s}s") from None
    except ValueError as exc:  # unauthenticated or malformed reply
        raise ConnectionError(f"side channel {host}:{port}: {exc}") from None
    finally:
        sock.close(0)
    if isinstance(reply, ErrorReply):
        raise ConnectionError(f"side channel {host}:{port} refused: {reply.message}")
    return reply
