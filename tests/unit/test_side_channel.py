"""The side channel keeps serving whatever arrives, and handshake replies are validated."""

import socket
import time

import pytest
import zmq

from testbed.handshake_ranks import rank_meta
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.peers import RETRY_AFTER_S, PeerDirectory, check_ranks
from vllm_qaic_connector.protocol.side_channel import MAX_MESSAGE_BYTES, SideChannelServer
from vllm_qaic_connector.protocol.wire import (
    PROTOCOL_VERSION,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Message,
    Ok,
    RankMetadata,
    ReleaseRequest,
    TransportEndpoint,
    encode_message,
    open_message,
)

KEY = b"secret"


def rank(**over) -> RankMetadata:
    return rank_meta(**{"engine_id": "pf", **over})


def ranks(tp: int, **over) -> list[RankMetadata]:
    return [rank(tp_rank=i, tp_size=tp, **over) for i in range(tp)]


def echo(msg: Message) -> Message:
    if isinstance(msg, ReleaseRequest):
        return ErrorReply("echo:" + ",".join(msg.request_ids))
    return Ok()


@pytest.fixture(params=[None, KEY], ids=["nokey", "key"])
def key(request):
    return request.param


@pytest.fixture
def server(key):
    srv = SideChannelServer("127.0.0.1", 0, echo, key)
    yield srv
    srv.close()


def assert_serves(port: int, key: bytes | None, tag: str = "ok") -> None:
    """A valid round trip gets its own answer (the ErrorReply echo names the request)."""
    with pytest.raises(ConnectionError, match=f"echo:{tag}$"):
        side_channel.call("127.0.0.1", port, ReleaseRequest([tag]), key, 10.0)
    assert side_channel.call("127.0.0.1", port, HandshakeRequest(1, "x"), key, 10.0) == Ok()


def dealer(ctx: zmq.Context, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)  # closes sockets a failed test left open; term() would hang


def test_single_frame_is_dropped(server, key, ctx):
    sock = dealer(ctx, server.port)
    sock.send(b"only-one-frame")
    assert_serves(server.port, key)
    assert not sock.poll(200)  # no envelope to answer into: dropped silently
    sock.close(0)


def test_five_frames_get_an_error_reply(server, key, ctx):
    sock = dealer(ctx, server.port)
    sock.send_multipart([b"", b"a", b"b", b"c"])  # the ROUTER adds the identity: 5 frames
    empty, frame = sock.recv_multipart()
    reply = _decode(frame, key)
    assert empty == b"" and isinstance(reply, ErrorReply)
    assert "one payload frame, got 3" in reply.message
    assert_serves(server.port, key)
    sock.close(0)


def test_missing_delimiter_is_dropped(server, key, ctx):
    sock = dealer(ctx, server.port)
    sock.send_multipart([b"not-empty", encode_message(ReleaseRequest(["x"]), key)])
    assert_serves(server.port, key)
    assert not sock.poll(200)
    sock.close(0)


@pytest.mark.parametrize("payload", [b"", b"\x00", b"garbage" * 10, b"\0" * 32 + b"\x93garbage"])
def test_garbage_gets_an_error_reply(server, key, ctx, payload):
    sock = dealer(ctx, server.port)
    sock.send_multipart([b"", payload])
    _, frame = sock.recv_multipart()
    reply = _decode(frame, key)
    assert isinstance(reply, ErrorReply)
    assert "malformed" in reply.message or "authentication" in reply.message
    assert_serves(server.port, key)
    sock.close(0)


def test_truncated_mac_is_refused(ctx):
    srv = SideChannelServer("127.0.0.1", 0, echo, KEY)
    try:
        sock = dealer(ctx, srv.port)
        for cut in (1, 16, 31, 40):
            sock.send_multipart([b"", encode_message(ReleaseRequest(["x"]), KEY)[:cut]])
            reply = _decode(sock.recv_multipart()[1], KEY)
            assert isinstance(reply, ErrorReply) and "authentication" in reply.message
        assert_serves(srv.port, KEY)
        sock.close(0)
    finally:
        srv.close()


def test_oversized_message_is_dropped(server, key, ctx):
    sock = dealer(ctx, server.port)
    big = encode_message(ReleaseRequest(["x" * MAX_MESSAGE_BYTES]), key)
    assert len(big) > MAX_MESSAGE_BYTES
    sock.send_multipart([b"", big])
    assert_serves(server.port, key)
    assert not sock.poll(200)  # libzmq dropped the connection, not the server
    sock.close(0)
    # A request just under the limit still gets through.
    ok = "y" * (MAX_MESSAGE_BYTES // 2)
    with pytest.raises(ConnectionError, match=f"echo:{ok}$"):
        side_channel.call("127.0.0.1", server.port, ReleaseRequest([ok]), key, 10.0)


def test_flood_of_garbage_connections(server, key, ctx):
    socks = [dealer(ctx, server.port) for _ in range(200)]
    for i, sock in enumerate(socks):
        sock.send_multipart([b"", b"junk%d" % i] if i % 2 else [b"junk"])
    for sock in socks[1::2]:  # each enveloped one was read and answered
        assert isinstance(_decode(sock.recv_multipart()[1], key), ErrorReply)
    for sock in socks:
        sock.close(0)
    for _ in range(20):  # raw TCP that never speaks ZMTP
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
    assert_serves(server.port, key)


def test_raising_handler_answers_with_an_error():
    def handler(msg: Message) -> Message:
        raise RuntimeError("boom")

    srv = SideChannelServer("127.0.0.1", 0, handler, None)
    try:
        for _ in range(2):
            with pytest.raises(ConnectionError, match="refused: boom"):
                side_channel.call("127.0.0.1", srv.port, Ok(), None, 10.0)
    finally:
        srv.close()


@pytest.mark.parametrize(
    ("bound", "asked"),
    [("::1", "::1"), ("::1", "[::1]"), ("[::1]", "::1"), ("127.0.0.1", "localhost")],
)
def test_ipv6_hosts_serve_bracketed_or_not(bound, asked):
    """An IPv6 side channel (an IPv6-only cluster's pod address), named as operators and
    routers write it: before, its engine failed to start (libzmq wants [::1], and IPv6 on)."""
    srv = SideChannelServer(bound, 0, echo, KEY)
    try:
        assert side_channel.call(asked, srv.port, HandshakeRequest(1, "x"), KEY, 10.0) == Ok()
    finally:
        srv.close()


def test_call_to_a_malformed_address_is_a_connection_error():
    with pytest.raises(ConnectionError):
        side_channel.call("bad host!", 5, Ok(), None, 1.0)


# --- handshake replies ---------------------------------------------------------------------


def second(**over) -> list[RankMetadata]:
    """Two ranks, the second differing in ``over``."""
    return [rank(tp_size=2), rank(tp_rank=1, tp_size=2, **over)]


def test_check_ranks_accepts_valid_and_names_the_bad_field():
    assert check_ranks(ranks(1)) is None
    assert check_ranks(ranks(2)) is None
    bad = {
        "no ranks": [],
        "rank 0 block_size must be > 0, got -4": [rank(block_size=-4)],
        "rank 0 num_blocks must be > 0": [rank(num_blocks=0)],
        "rank 0 head_size must be > 0": [rank(head_size=0)],
        "rank 0 num_kv_heads must be > 0": [rank(num_kv_heads=0)],
        "rank 0 num_layers must be > 0": [rank(num_layers=0)],
        "rank 0 tp_size must be > 0, got 0": [rank(tp_size=0)],
        "rank 0 tp_size is 2 but the reply has 1 ranks": [rank(tp_size=2)],
        "rank 1 has tp_rank 2": [rank(tp_size=2), rank(tp_rank=2, tp_size=2)],
        "rank 0 has tp_rank 1": [rank(tp_rank=1, tp_size=2), rank(tp_size=2)],
        "layout_kind 'weird' is unknown": [rank(layout_kind="weird")],
        "dtype 'float33' is unknown": [rank(dtype="float33")],
        "endpoint.kind 'tcp' is unknown": [rank(endpoint=TransportEndpoint("tcp", "a", 1))],
        "endpoint.size must be >= 0, got -1": [rank(endpoint=TransportEndpoint("shm", "a", -1))],
        "rank 1 engine_id 'other' differs": second(engine_id="other"),
        "rank 1 block_size 32 differs": second(block_size=32),
        "rank 1 layout_kind 'LBNHC' differs": second(layout_kind="LBNHC"),
        "rank 1 num_layers 3 differs": second(num_layers=3),
        "rank 1 head_size 64 differs": second(head_size=64),
    }
    for why, rs in bad.items():
        problem = check_ranks(rs)
        assert problem is not None and why in problem, (why, problem)
    # A shm decode that only loads has no segment; a prefill handshaking with it for its
    # format must accept that (a refusal made every such prefill stage in its own format).
    assert check_ranks([rank(endpoint=TransportEndpoint("shm", "", 0))]) is None
    assert "is not the name its handshake implies" in (
        check_ranks([rank(endpoint=TransportEndpoint("shm", "a", 0))]) or ""
    )


class _Peer:
    """A real side-channel server that answers handshakes with the given reply."""

    def __init__(self, reply: Message) -> None:
        self.reply = reply
        self.server = SideChannelServer("127.0.0.1", 0, lambda msg: self.reply, None)


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (HandshakeReply(PROTOCOL_VERSION, [rank(block_size=0)]), "rank 0 block_size must be > 0"),
        (HandshakeReply(PROTOCOL_VERSION, [rank(layout_kind="weird")]), "layout_kind 'weird'"),
        (
            HandshakeReply(PROTOCOL_VERSION, [rank(tp_size=2), rank(tp_rank=2, tp_size=2)]),
            "rank 1 has tp_rank 2",
        ),
        (HandshakeReply(PROTOCOL_VERSION, []), "no ranks"),
        (Ok(), "got Ok"),
    ],
    ids=["block_size", "layout", "tp_rank_gap", "empty", "not_a_handshake"],
)
def test_bad_handshake_reply_refuses_the_peer(reply, why):
    peer = _Peer(reply)
    try:
        directory = PeerDirectory("dec", None, 10.0)
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="bad handshake reply from 127.0.0.1:") as exc:
            directory.get("127.0.0.1", peer.server.port)
        assert why in str(exc.value)
        assert time.monotonic() - start < 5
        assert directory.poll("127.0.0.1", peer.server.port) == str(exc.value)  # cached
    finally:
        peer.server.close()


def test_good_handshake_and_forget():
    peer = _Peer(HandshakeReply(PROTOCOL_VERSION, ranks(2)))
    try:
        directory = PeerDirectory("dec", None, 10.0)
        port = peer.server.port
        assert directory.get("127.0.0.1", port) == ranks(2)
        peer.reply = HandshakeReply(PROTOCOL_VERSION, ranks(1, engine_id="pf2"))
        assert directory.get("127.0.0.1", port) == ranks(2)  # cached
        directory.forget("127.0.0.1", port)
        assert directory.poll("127.0.0.1", port) is None  # pending, never blocks
        assert directory.get("127.0.0.1", port) == ranks(1, engine_id="pf2")
        directory.forget("127.0.0.1", port + 1)  # unknown: a no-op
    finally:
        peer.server.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_closed_port_is_refused_at_once():
    directory = PeerDirectory("dec", None, 10.0)  # a retried timeout would take 30 s
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="connection refused by 127.0.0.1:"):
        directory.get("127.0.0.1", _closed_port())
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("host", "port", "why"),
    [
        ("127.0.0.1", -1, "port must be in 1..65535, got -1"),
        ("127.0.0.1", 0, "port must be in 1..65535, got 0"),
        ("127.0.0.1", 65536, "port must be in 1..65535, got 65536"),
        ("bad host!", 5000, "host 'bad host!' is not a host name"),
        ("", 5000, "host '' is not a host name"),
    ],
)
def test_malformed_address_fails_at_once(host, port, why):
    directory = PeerDirectory("dec", None, 10.0)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="bad peer address") as exc:
        directory.get(host, port)
    assert why in str(exc.value)
    assert time.monotonic() - start < 5


def test_unknown_host_is_named():
    directory = PeerDirectory("dec", None, 10.0)
    with pytest.raises(ConnectionError, match="'no-such-host.invalid' does not resolve"):
        directory.get("no-such-host.invalid", 5000)


def test_handshake_bug_fails_the_peer_instead_of_hanging(monkeypatch):
    directory = PeerDirectory("dec", None, 10.0)

    def broken(host: str, port: int) -> list[RankMetadata]:
        raise KeyError("bug")

    monkeypatch.setattr(directory, "_handshake", broken)
    with pytest.raises(ConnectionError, match="KeyError"):
        directory.get("127.0.0.1", 5000)
    result = directory.poll("127.0.0.1", 5000)
    assert isinstance(result, str) and "KeyError" in result


def test_a_load_keeps_the_failure_it_waited_on_a_new_lookup_retries():
    """A load that waited on a handshake takes that handshake's outcome, however late it
    looks (a busy loader used to start a silent peer's handshake over: twice the wait);
    a later lookup retries the peer."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # connections complete, nothing ever answers
    port = hole.getsockname()[1]
    directory = PeerDirectory("dec", None, 0.2)
    try:
        deadline = time.monotonic() + 10
        while not isinstance(directory.poll("127.0.0.1", port), str):
            assert time.monotonic() < deadline, "the silent peer's handshake never failed"
            time.sleep(0.05)
        time.sleep(RETRY_AFTER_S + 0.2)  # the failure is old enough to be retried
        failed = directory.poll("127.0.0.1", port, retry=False)
        assert isinstance(failed, str) and "silent" in failed
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="silent"):
            directory.get("127.0.0.1", port, retry=False)
        assert time.monotonic() - start < 0.1  # the old outcome, no new wait
        assert directory.poll("127.0.0.1", port) is None  # a new lookup: handshaking again
    finally:
        hole.close()


def _decode(frame, key):
    return open_message(frame, key).message
