"""The NIXL transport between real processes: real agents, real UCX READs, no mocks.

The owner of a staging region is always `testbed/nixl_peer.py` in a child process; the reader is
this process, or another `nixl_peer.py` when it must sit in another network namespace.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nixl  # noqa: E402, F401  (NIXL missing is a failure, never a skip)
import pytest
import torch

from testbed.netns import rx_bytes, veth_link
from testbed.nixl_peer import PEER_SCRIPT, RANGES, SEED, SIZE, Peer, decode, encode, pattern  # noqa: E402
from testbed.worker_processes import make_worker  # noqa: E402
from vllm_qaic_connector.protocol.wire import TransportEndpoint  # noqa: E402
from vllm_qaic_connector.transports.nixl import NixlTransport, split_address  # noqa: E402

pytestmark = pytest.mark.nixl
PID = os.getpid()


def start_owner(
    name: str, env: dict[str, str] | None = None, prefix: list[str] | None = None
) -> tuple[Peer, TransportEndpoint]:
    peer = Peer([*(prefix or []), sys.executable, str(PEER_SCRIPT), "owner", "--name", name], env)
    try:
        return peer, decode(peer.expect("ENDPOINT"))
    except BaseException:
        peer.kill()
        raise


@pytest.fixture
def owner_factory() -> Iterator:
    started: list[Peer] = []

    def start(name: str, env: dict[str, str] | None = None) -> tuple[Peer, TransportEndpoint]:
        peer, endpoint = start_owner(name, env)
        started.append(peer)
        return peer, endpoint

    yield start
    for peer in started:
        peer.kill()
        print(f"--- owner pid {peer.proc.pid} output:\n{''.join(peer.log)}")  # shown on failure


WANT = pattern(SEED, SIZE)


@pytest.mark.parametrize("ucx_tls", [None, "tcp"], ids=["loopback-default", "ucx-tcp"])
def test_reader_gets_owner_bytes_and_owner_gets_notification(owner_factory, monkeypatch, ucx_tls):
    env = {"UCX_TLS": ucx_tls} if ucx_tls else {}
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the reader's UCX context, created below, too
    owner, endpoint = owner_factory(f"qaic_owner_{PID}_{ucx_tls}", env)
    agent, base = split_address(endpoint.address)
    assert agent == f"qaic_owner_{PID}_{ucx_tls}" and base != 0 and endpoint.size == SIZE
    reader = NixlTransport(f"qaic_reader_{PID}", 1 << 20, timeout_s=30.0)
    try:
        # Hold every range at once: arena slices and the one-off 8 MiB buffer must not overlap.
        got = {offset: reader.read(endpoint, offset, nbytes) for offset, nbytes in RANGES}
        for offset, nbytes in RANGES:
            assert got[offset].dtype == torch.uint8 and got[offset].numel() == nbytes
            assert torch.equal(got[offset], WANT[offset : offset + nbytes]), (offset, nbytes)
        for offset, _ in RANGES:
            reader.release_read(endpoint, offset)
        assert owner.notifications() == []  # plain reads carry no message
        # 9 MiB: 1 MiB descriptors, split between UCX's copy threads; the message comes last
        again = reader.read(endpoint, 7, (9 << 20) + 3, notify=b"req-1")
        assert torch.equal(again, WANT[7 : 7 + (9 << 20) + 3])
        reader.release_read(endpoint, 7)
        assert b"req-1" in owner.wait_for_notification(b"req-1")
        for bad in [(SIZE - 10, 11), (-1, 10), (0, 0)]:
            with pytest.raises(ValueError, match="outside"):
                reader.read(endpoint, *bad)
    finally:
        reader.close()
    assert owner.close() == "0 0"


def test_close_deregisters_and_removes_agents_and_is_idempotent(owner_factory):
    owner, endpoint = owner_factory(f"qaic_owner_{PID}_close")
    reader = NixlTransport(f"qaic_reader_{PID}_close", 1 << 20)
    reader.read(endpoint, 0, 4096)  # arena
    reader.read(endpoint, 100, 2 << 20)  # larger than the arena: one-off registration
    agent, regs = reader._agent, list(reader._regs)
    owner_name = split_address(endpoint.address)[0]
    # staging + arena + one-off
    assert reader.registrations == 3 and reader.remote_agents == [owner_name]
    assert agent.check_remote_metadata(owner_name)
    reader.close()
    reader.close()
    assert reader.registrations == 0 and reader.remote_agents == []
    assert not agent.check_remote_metadata(owner_name)
    for reg in regs:  # nixl itself no longer knows any of them
        with pytest.raises(Exception, match="NOT_FOUND"):
            agent.deregister_memory(reg)
    with pytest.raises(RuntimeError, match="closed"):
        reader.read(endpoint, 0, 16)
    assert reader.poll_notifications() == []
    assert owner.close() == "0 0"


def test_reading_from_an_exited_peer_is_a_connection_error(owner_factory):
    name = f"qaic_owner_{PID}_gone"
    owner, endpoint = owner_factory(name)
    connected = NixlTransport(f"qaic_reader_{PID}_a", 1 << 20, timeout_s=10.0)
    fresh = NixlTransport(f"qaic_reader_{PID}_b", 1 << 20, timeout_s=10.0)
    try:
        assert torch.equal(connected.read(endpoint, 0, 4096), WANT[:4096])
        connected.release_read(endpoint, 0)
        owner.kill()  # SIGKILL: no close, no goodbye
        for reader in (connected, fresh):
            start = time.monotonic()
            with pytest.raises(ConnectionError, match=name):
                reader.read(endpoint, 0, 4096)
            assert time.monotonic() - start < 10.0 + 2.0
    finally:
        connected.close()
        fresh.close()


def test_a_stalled_peer_times_out_instead_of_hanging(owner_factory):
    name = f"qaic_owner_{PID}_stalled"
    owner, endpoint = owner_factory(name)
    reader = NixlTransport(f"qaic_reader_{PID}_stalled", 1 << 20, timeout_s=2.0)
    os.kill(owner.proc.pid, signal.SIGSTOP)  # alive but never answers the connection
    try:
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=f"{name}.*timed out"):
            reader.read(endpoint, 0, 4096)
        assert 2.0 <= time.monotonic() - start < 10.0
    finally:
        os.kill(owner.proc.pid, signal.SIGCONT)
        reader.close()


@pytest.mark.netns
def test_across_network_namespaces_over_a_veth_link():
    """Owner and reader in two network namespaces joined by a veth pair, UCX over TCP only:
    the bytes cross a network link, not shared memory or loopback."""
    owner: Peer | None = None
    with veth_link(f"qv{PID}", "10.77.0") as link:
        try:
            rx_before = rx_bytes(link.ns_b, link.dev_b)
            name = f"qaic_owner_{PID}_netns"
            owner, endpoint = start_owner(name, link.tcp_env("a"), prefix=link.exec_in("a"))
            argv = [
                str(PEER_SCRIPT),
                "reader",
                encode(endpoint),
                "--name",
                f"qaic_reader_{PID}_netns",
            ]
            result, out, rc = link.run_result("b", argv, timeout=60)
            assert result["mismatches"] == [] and result["notify_read_ok"], out
            assert result["bytes"] == sum(n for _, n in RANGES)
            assert result["registrations_after_close"] == 0
            assert rc == 0, out
            # The READs really crossed the veth link into the reader's namespace.
            assert rx_bytes(link.ns_b, link.dev_b) - rx_before >= result["bytes"]
            assert b"req-1" in owner.wait_for_notification(b"req-1")
            assert owner.close() == "0 0"
        finally:
            if owner is not None:
                owner.kill()
                print(f"--- owner output:\n{''.join(owner.log)}")


def test_forget_peer_drops_its_reads_and_a_later_read_reconnects():
    # Both agents in this process: NIXL still moves the bytes through UCX.
    owner = NixlTransport(f"qaic_owner_{PID}_local", 1 << 16)
    reader = NixlTransport(f"qaic_reader_{PID}_local", 1 << 16)
    try:
        owner.staging.copy_(WANT[: 1 << 16])
        endpoint = owner.endpoint()
        reader.read(endpoint, 0, 100)
        reader.read(endpoint, 0, 1 << 16)  # same key, and bigger than what is left: one-off
        assert reader.registrations == 3
        reader.forget_peer(endpoint)
        assert reader.remote_agents == [] and reader.registrations == 2  # one-off dropped
        assert torch.equal(reader.read(endpoint, 5, 50, notify=b"again"), WANT[5:55])
        deadline = time.monotonic() + 10
        seen: list[bytes] = []
        while b"again" not in seen and time.monotonic() < deadline:
            seen += owner.poll_notifications()
            time.sleep(0.01)
        assert b"again" in seen
    finally:
        reader.close()
        owner.close()


def test_a_worker_registers_only_its_staging_so_its_kv_cache_cannot_be_read():
    """Least exposure: a real worker's NIXL agent registers its staging region, not its KV
    caches, so a peer that knows a KV cache's address still cannot READ it."""
    args = {"engine": f"nx{PID}", "rank": 0, "tp": 1, "total_heads": 2, "block": 16}
    extra = {"transport": "nixl", "staging_bytes": 1 << 20}
    worker = make_worker({**args, "layout": "LBNHC", "extra": extra}, seed=0)
    reader = NixlTransport(f"qaic_reader_{PID}_kv", 1 << 16, timeout_s=10.0)
    try:
        own = worker.transport
        assert isinstance(own, NixlTransport) and own.registrations == 1  # staging only
        own.staging[:64] = torch.arange(64, dtype=torch.uint8)
        staging = own.endpoint()
        assert torch.equal(reader.read(staging, 0, 64), own.staging[:64])
        assert reader.registrations == 2  # its staging + the receive arena of that read
        agent = split_address(staging.address)[0]
        key = worker.layers[0][0]
        assert key.abs().sum() > 0  # random KV: a successful read would be noticed
        kv = TransportEndpoint("nixl", f"{agent}@{key.data_ptr():#x}", 4096, staging.agent_metadata)
        with pytest.raises(ConnectionError, match=agent):
            reader.read(kv, 0, 4096)
    finally:
        reader.close()
        worker.shutdown()


def _resident_kib_at(address: int) -> int:
    """Resident KiB of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]
        if "-" in span and all(c in "0123456789abcdef-" for c in span):
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return next(int(x.split()[1]) for x in lines[i + 1 :] if x.startswith("Rss:"))
    raise LookupError(hex(address))


@pytest.mark.parametrize("stages", [True, False])
def test_a_staging_rank_has_its_staging_faulted_in_at_creation(stages):
    """A rank that saves has its staging resident before the first save writes it (a first
    write into a fresh page costs many times the copy); a decode's stays uncommitted."""
    t = NixlTransport(f"qaic_resident_{PID}_{stages}", 8 << 20, stages=stages)
    try:
        resident = _resident_kib_at(t.staging.data_ptr())
        assert resident >= 8 << 10 if stages else resident < 8 << 10
    finally:
        t.close()
