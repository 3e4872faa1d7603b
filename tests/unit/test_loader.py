"""The loader: loads run concurrently, one stuck on a dead peer costs only itself, and a
load past its deadline is reported once and can no longer write."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_qaic_connector.worker.loader import Loader, LoadTimeout, WriteGate


class Peers:
    """Load functions: 'dead' blocks until released, others write at once."""

    def __init__(self) -> None:
        self.release_dead = threading.Event()
        self.writes: list[str] = []
        self.refused: list[str] = []

    def run(self, spec: str, gate: WriteGate) -> tuple[str, bool]:
        if spec.startswith("dead"):
            self.release_dead.wait(30)
        try:
            with gate.writing():
                self.writes.append(spec)
        except LoadTimeout:
            self.refused.append(spec)
            raise
        return spec, True

    @staticmethod
    def fail(spec: str, reason: str) -> tuple[str, bool]:
        return spec, False


def wait_for(loader: Loader, n: int, limit_s: float = 20.0) -> list[tuple[str, bool]]:
    got: list[tuple[str, bool]] = []
    deadline = time.monotonic() + limit_s
    while len(got) < n and time.monotonic() < deadline:
        got += loader.take_finished()
        time.sleep(0.01)
    return got


def test_a_dead_peer_delays_only_its_own_load():
    peers = Peers()
    loader = Loader(peers.run, peers.fail, timeout_s=1.0)
    try:
        loader.submit("dead-1", "dead")
        for i in range(6):
            loader.submit(f"good-{i}", "good")
        good = wait_for(loader, 6)
        assert sorted(good) == [(f"good-{i}", True) for i in range(6)]
        # The dead one is reported failed once its deadline passes ...
        assert wait_for(loader, 1) == [("dead-1", False)]
        # ... and when its peer finally answers, it neither writes nor reports again.
        peers.release_dead.set()
        time.sleep(0.3)
        assert peers.refused == ["dead-1"] and "dead-1" not in peers.writes
        assert loader.take_finished() == []
    finally:
        peers.release_dead.set()
        loader.shutdown()


def test_a_flood_at_one_dead_peer_leaves_threads_for_the_others():
    """20 loads block on one peer (its reads hang) and 20 more wait for its handshake:
    the peer holds at most half the threads, so good peers' loads still run at once."""
    peers = Peers()
    handshake_done = threading.Event()
    loader = Loader(peers.run, peers.fail, timeout_s=30.0)
    try:
        for i in range(20):
            loader.submit(f"dead-{i}", "dead")
            loader.submit(f"dead-hs-{i}", "black-hole", handshake_done.is_set)
        t0 = time.monotonic()
        for i in range(8):
            loader.submit(f"good-{i}", ("good", i % 2))
        good = wait_for(loader, 8, limit_s=10.0)
        assert sorted(good) == sorted((f"good-{i}", True) for i in range(8))
        assert time.monotonic() - t0 < 5.0
    finally:
        peers.release_dead.set()
        loader.shutdown()


@pytest.mark.parametrize("exc", [ConnectionError("peer gone"), ValueError("bad ticket")])
def test_a_failing_load_is_reported_failed(exc):
    def run(spec: str, gate: WriteGate) -> tuple[str, bool]:
        raise exc

    loader = Loader(run, Peers.fail, timeout_s=5.0)
    try:
        loader.submit("x")
        assert wait_for(loader, 1) == [("x", False)]
    finally:
        loader.shutdown()


def test_wait_returns_when_these_loads_are_done_or_at_its_bound():
    """An idle engine waits for the loads it just started: a quick one is reported by the
    same step; one stuck on a dead peer (or started earlier) holds the wait only to its
    bound, and stays in flight."""
    peers = Peers()
    loader = Loader(peers.run, peers.fail, timeout_s=30.0)
    try:
        stuck = loader.submit("dead-1", "dead")  # an earlier step's load, never done
        quick = loader.submit("good-1", "good")
        t0 = time.monotonic()
        loader.wait([quick], 10.0)
        assert time.monotonic() - t0 < 5.0, "waited on a load it was not asked about"
        assert loader.take_finished() == [("good-1", True)]
        t0 = time.monotonic()
        loader.wait([stuck], 0.2)
        assert 0.2 <= time.monotonic() - t0 < 5.0
        assert loader.take_finished() == []
    finally:
        peers.release_dead.set()
        loader.shutdown()


def test_a_load_parked_on_a_handshake_starts_when_it_resolves_with_no_engine_step():
    """A lone request to an idle engine: nothing calls the loader again (no step, no other
    load), so the handshake's resolution itself must start the parked load."""
    from vllm_qaic_connector.protocol.peers import PeerDirectory
    from vllm_qaic_connector.protocol.side_channel import SideChannelServer
    from vllm_qaic_connector.protocol.wire import ErrorReply, Message

    def slow_peer(_: Message) -> Message:
        time.sleep(0.5)  # a peer that takes its time: the load parks first
        return ErrorReply("engine not ready")

    server = SideChannelServer("127.0.0.1", 0, slow_peer, None)
    peers = PeerDirectory("decode", None, timeout_s=5.0)
    started = threading.Event()

    def run(spec: str, gate: WriteGate) -> tuple[str, bool]:
        started.set()
        return spec, True

    loader = Loader(run, Peers.fail, timeout_s=30.0)
    peers.when_resolved(loader.dispatch)
    try:
        assert peers.poll("127.0.0.1", server.port) is None  # the handshake is under way
        loader.submit("r1", "peer", lambda: peers.poll("127.0.0.1", server.port, False) is not None)
        assert not started.is_set()  # parked on the handshake
        assert started.wait(10.0), "the load stayed parked after its handshake resolved"
    finally:
        loader.shutdown()
        server.close()
