"""Issue #10: keys, replay-proof side-channel frames, MAC'd NIXL acknowledgements.

Real sockets, real NIXL agents and a real vLLM scheduler; signed tickets are tested in
test_scheduler_side.py and, through HTTP on live servers, in test_faults.py.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from testbed.handshake_ranks import rank_meta
from testbed.vllm_harness import BS, make_request, make_scheduler, params_of, step
from vllm_qaic_connector.config import is_loopback, parse_config
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.keys import KEY_ENV, load_key
from vllm_qaic_connector.protocol.side_channel import SideChannelServer
from vllm_qaic_connector.protocol.wire import (
    PROTOCOL_VERSION,
    Envelope,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Message,
    Ok,
    ReleaseRequest,
    ack_message,
    encode_message,
    open_message,
    parse_ack,
)

KEY = b"0123456789abcdef0123456789abcdef"

# --- keys -----------------------------------------------------------------------------------


def key_file(tmp_path, content: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "kv.key"
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


def test_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert parse_config({}).shared_key is None
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    assert parse_config({}).shared_key == KEY
    path = key_file(tmp_path, b"file-key-0123456789\n")
    assert parse_config({"side_channel_key_file": path}).shared_key == b"file-key-0123456789"


def test_a_key_in_the_config_is_refused_without_echoing_it():
    with pytest.raises(ValueError, match="side_channel_key_file") as err:
        parse_config({"side_channel_key": "hunter2-hunter2-hunter2"})
    assert "hunter2" not in str(err.value)


@pytest.mark.parametrize(
    "content,mode,why",
    [
        (b"a-long-enough-key-xyz", 0o644, "open to other users"),
        (b"tiny-k3y", 0o600, "shorter than 16 bytes"),
        (b"\n", 0o600, "is empty"),
    ],
)
def test_unusable_key_files_are_named(tmp_path, content, mode, why):
    path = key_file(tmp_path, content, mode)
    with pytest.raises(ValueError, match=why) as err:
        parse_config({"side_channel_key_file": path})
    assert path in str(err.value)
    if content.strip():
        assert content.decode().strip() not in str(err.value)


def test_key_file_must_exist_and_not_be_a_symlink(tmp_path):
    with pytest.raises(ValueError, match="No such file"):
        load_key(str(tmp_path / "missing"))
    target = key_file(tmp_path, KEY)
    os.symlink(target, tmp_path / "link")
    with pytest.raises(ValueError, match="side_channel_key_file"):
        load_key(str(tmp_path / "link"))


def test_non_loopback_bind_needs_a_key_or_an_explicit_opt_out(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    for host in ("127.0.0.1", "localhost", "::1"):
        parse_config({"side_channel_host": host})
    with pytest.raises(ValueError, match="not a loopback address and no key"):
        parse_config({"side_channel_host": "0.0.0.0"})
    assert parse_config({"side_channel_host": "0.0.0.0", "allow_unauthenticated": True})
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    assert parse_config({"side_channel_host": "0.0.0.0"}).shared_key == KEY


@pytest.mark.parametrize("every_address", ["0.0.0.0", "::"])
def test_a_prefill_bound_to_every_address_advertises_one_a_peer_can_dial(
    monkeypatch, every_address
):
    """The side channel opened the first way an operator types it: the ticket a real vLLM
    scheduler issues names this host's address (vLLM's own pick: VLLM_HOST_IP, else the
    default route's), which answers. Before, it named 0.0.0.0, which a decode on another
    host dials as itself: every handoff across hosts failed and recomputed."""
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    sched = make_scheduler("kv_producer", BS, {"side_channel_host": every_address})
    sched.connector.scheduler.set_rank_metadata([rank_meta()])
    try:
        sched.add_request(make_request("p1", 45, {"do_remote_decode": True}))
        _, outputs = step(sched)
        params = params_of(outputs, "p1")
        assert params is not None
        host, port = params["remote_host"], params["remote_port"]
        assert host.strip("[]") not in ("0.0.0.0", "::") and not is_loopback(host), host
        reply = side_channel.call(host, port, HandshakeRequest(PROTOCOL_VERSION, "d"), KEY, 10)
        assert isinstance(reply, HandshakeReply)
    finally:
        sched.connector.shutdown()
    monkeypatch.setenv("VLLM_HOST_IP", "203.0.113.7")  # an operator's pick wins
    assert parse_config({"side_channel_host": every_address}).advertise_host == "203.0.113.7"


# --- replay-proof side channel ------------------------------------------------------------


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


class Recorder:
    def __init__(self) -> None:
        self.seen: list[Message] = []

    def __call__(self, msg: Message) -> Message:
        self.seen.append(msg)
        return Ok()


@pytest.fixture
def recorded() -> Iterator[tuple[SideChannelServer, Recorder]]:
    handler = Recorder()
    server = SideChannelServer("127.0.0.1", 0, handler, KEY)
    yield server, handler
    server.close()


def round_trip(ctx: zmq.Context, port: int, frame: bytes) -> bytes:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"", frame])
    _, reply = sock.recv_multipart()
    sock.close(0)
    return reply


def test_a_replayed_frame_is_refused(recorded, ctx):
    server, handler = recorded
    captured = encode_message(ReleaseRequest(["r1"]), KEY)
    assert _decode(round_trip(ctx, server.port, captured), KEY) == Ok()
    replay = _decode(round_trip(ctx, server.port, captured), KEY)
    assert isinstance(replay, ErrorReply) and "replayed" in replay.message
    assert handler.seen == [ReleaseRequest(["r1"])]  # the handler ran once


def signed_frame(message: Message, sent_at: float, key: bytes = KEY) -> bytes:
    """A frame built from the documented format, not from encode_message."""
    payload = msgspec.msgpack.encode(Envelope(os.urandom(16), sent_at, b"", message))
    return hmac.new(key, b"side-channel\0" + payload, hashlib.sha256).digest() + payload


@pytest.mark.parametrize("age_s", [100.0, -100.0])
def test_a_stale_or_future_frame_is_refused(recorded, ctx, age_s):
    server, handler = recorded
    frame = signed_frame(ReleaseRequest(["r1"]), time.time() - age_s)
    reply = _decode(round_trip(ctx, server.port, frame), KEY)
    assert isinstance(reply, ErrorReply) and "stale message" in reply.message
    fresh = signed_frame(ReleaseRequest(["r2"]), time.time())
    assert _decode(round_trip(ctx, server.port, fresh), KEY) == Ok()
    assert handler.seen == [ReleaseRequest(["r2"])]


def test_a_replayed_reply_is_refused(recorded, ctx):
    """A captured reply, served again by an impostor, does not answer a new request."""
    server, _ = recorded
    captured_reply = round_trip(ctx, server.port, encode_message(ReleaseRequest(["a"]), KEY))
    impostor = ctx.socket(zmq.ROUTER)
    impostor.setsockopt(zmq.LINGER, 0)
    port = impostor.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        ident, empty, _ = impostor.recv_multipart()
        impostor.send_multipart([ident, empty, captured_reply])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    with pytest.raises(ConnectionError, match="does not answer our request"):
        side_channel.call("127.0.0.1", port, ReleaseRequest(["b"]), KEY, 10.0)
    thread.join(5)


# --- MAC'd NIXL acknowledgements ------------------------------------------------------------


def test_acks_are_authenticated():
    ack = ack_message("r1", 0, 1, 0, KEY)
    assert parse_ack(ack, KEY) == ReleaseRequest(["r1"], 0, 1, [0])
    assert parse_ack(ack_message("r1", 0, 1, 0, None), KEY) is None
    assert parse_ack(ack_message("r1", 0, 1, 0, b"x" * 32), KEY) is None
    # A side-channel frame's MAC is no acknowledgement's (one key, separate purposes).
    assert parse_ack(encode_message(ReleaseRequest(["r1"]), KEY), KEY) is None


@pytest.mark.nixl
def test_an_unauthenticated_nixl_ack_frees_nothing(monkeypatch):
    """Real NIXL READs carry the acks; a real prefill scheduler gets what its worker parses."""
    import nixl  # noqa: F401  (NIXL missing is a failure, never a skip)

    from vllm_qaic_connector.transports.nixl import NixlTransport

    monkeypatch.setenv(KEY_ENV, KEY.decode())
    sched = make_scheduler("kv_producer", BS, {"lease_s": 60.0})
    side = sched.connector.scheduler
    side.set_rank_metadata([rank_meta()])
    pid = os.getpid()
    owner = NixlTransport(f"qaic_auth_owner_{pid}", 1 << 16)
    reader = NixlTransport(f"qaic_auth_reader_{pid}", 1 << 16)
    try:
        sched.add_request(make_request("p1", 45, {"do_remote_decode": True}))
        _, outputs = step(sched)
        assert params_of(outputs, "p1") is not None and side.pool.has("p1")

        def deliver(note: bytes) -> int:
            reader.read(owner.endpoint(), 0, 64, notify=note)
            reader.release_read(owner.endpoint(), 0)
            deadline, got = time.monotonic() + 10, []
            while not got and time.monotonic() < deadline:
                got = owner.poll_notifications()
                time.sleep(0.01)
            acks = [a for m in got if (a := parse_ack(m, KEY))]
            side.update_connector_output(None, acks)
            return len(got)

        for forged in (ack_message("p1", 0, 1, 0, None), ack_message("p1", 0, 1, 0, b"y" * 32)):
            assert deliver(forged) == 1  # it arrived ...
            assert side.pool.has("p1")  # ... and freed nothing
        deliver(ack_message("p1", 0, 1, 0, KEY))
        assert not side.pool.has("p1")
    finally:
        reader.close()
        owner.close()
        sched.connector.shutdown()


def _decode(frame, key):
    return open_message(frame, key).message
