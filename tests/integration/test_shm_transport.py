"""The shm transport between two real processes, over real POSIX shared memory."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import warnings
from pathlib import Path

import pytest
import torch

from vllm_qaic_connector.protocol.wire import TransportEndpoint
from vllm_qaic_connector.transports import create_transport
from vllm_qaic_connector.transports.shm import SHM_DIR

SIZE = 1 << 20


def _owner(name: str, ready, done) -> None:
    t = create_transport("shm", name, SIZE, 5.0)
    t.staging[:] = torch.arange(SIZE, dtype=torch.int64).remainder(251).to(torch.uint8)
    ready.put(t.endpoint())
    done.get(timeout=30)
    t.close()


def test_peer_reads_owner_bytes_without_copy_and_nothing_leaks():
    name = f"qaic_kv_test_{os.getpid()}"
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_owner, args=(name, ready, done))
    proc.start()
    try:
        endpoint = ready.get(timeout=60)
        reader = create_transport("shm", name + "_reader", SIZE, 5.0)
        got = reader.read(endpoint, 4096, 8192)
        want = torch.arange(4096, 4096 + 8192).remainder(251).to(torch.uint8)
        assert torch.equal(got, want)
        # Zero copy: a second read of the same region aliases the same memory.
        assert reader.read(endpoint, 4096, 16).data_ptr() == got.data_ptr()
        with pytest.raises(ValueError, match="outside segment"):
            reader.read(endpoint, SIZE - 10, 100)
        del got
        reader.close()
        assert not os.path.exists(os.path.join(SHM_DIR, name + "_reader"))
    finally:
        done.put(1)
        proc.join(30)
    assert proc.exitcode == 0
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_segment_of_a_gone_peer_is_a_connection_error():
    reader = create_transport("shm", f"qaic_kv_test_r_{os.getpid()}", 4096, 5.0)
    try:
        with pytest.raises(ConnectionError, match="does not exist"):
            reader.read(TransportEndpoint("shm", "qaic_kv_no_such_segment", 4096), 0, 16)
    finally:
        reader.close()


def test_name_clash_is_refused():
    name = f"qaic_kv_test_clash_{os.getpid()}"
    first = create_transport("shm", name, 4096, 5.0)
    try:
        with pytest.raises(FileExistsError):
            create_transport("shm", name, 4096, 5.0)
    finally:
        first.close()


def _hold(name: str, ready) -> None:
    create_transport("shm", name, 4096, 5.0)
    ready.put(1)
    import time

    time.sleep(120)  # until killed


def test_segments_of_dead_incarnations_are_reclaimed_never_live_ones():
    """An engine SIGKILLed leaves its segment; the next start with the same engine id
    reclaims it (its creator's flock is gone), and leaves a live engine's segment alone."""
    import signal

    stem = f"qaic_kv_test_rc{os.getpid()}_r0_"
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    dead = ctx.Process(target=_hold, args=(stem + "dead", ready))
    live = ctx.Process(target=_hold, args=(stem + "live", ready))
    dead.start()
    live.start()
    try:
        ready.get(timeout=60)
        ready.get(timeout=60)
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(30)
        assert os.path.exists(os.path.join(SHM_DIR, stem + "dead"))  # SIGKILL left it
        restarted = create_transport("shm", stem + "new", 4096, 5.0)
        assert not os.path.exists(os.path.join(SHM_DIR, stem + "dead"))
        assert os.path.exists(os.path.join(SHM_DIR, stem + "live"))
        restarted.close()
    finally:
        live.kill()
        live.join(30)
        for suffix in ("dead", "live", "new"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, stem + suffix))


def _map_peer(endpoint: TransportEndpoint, out) -> None:
    """Reads a peer in a fresh process (torch warns once per process) with warnings as
    errors; returns the first byte and the permissions of the mappings of its segments."""
    warnings.simplefilter("error")
    try:
        reader = create_transport("shm", endpoint.address + "_rd", 4096, 5.0)
        first = int(reader.read(endpoint, 0, 16)[0])
        with open("/proc/self/maps") as f:
            maps = [line.split() for line in f if f"{SHM_DIR}/{endpoint.address}" in line]
        out.put((first, {m[5].rsplit("/", 1)[-1]: m[1] for m in maps}))
        reader.close()
    except Exception as exc:  # reported, not lost in the child's stderr
        out.put(repr(exc))


def test_peer_segment_is_mapped_read_only_and_without_a_warning():
    name = f"qaic_kv_test_ro{os.getpid()}"
    owner = create_transport("shm", name, 4096, 5.0)
    owner.staging[0] = 7
    out = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_map_peer, args=(owner.endpoint(), out))
    proc.start()
    try:
        got = out.get(timeout=60)
        assert got == (7, {name: "r--s", name + "_rd": "rw-s"}), got
    finally:
        proc.join(30)
        owner.close()
    assert proc.exitcode == 0


def test_symlink_named_like_a_peer_segment_is_refused():
    """O_NOFOLLOW: a link planted in /dev/shm does not map what it points to."""
    target = create_transport("shm", f"qaic_kv_test_tgt{os.getpid()}", 4096, 5.0)
    link = f"qaic_kv_test_link{os.getpid()}"
    os.symlink(os.path.join(SHM_DIR, target.endpoint().address), os.path.join(SHM_DIR, link))
    reader = create_transport("shm", f"qaic_kv_test_lr{os.getpid()}", 4096, 5.0)
    try:
        with pytest.raises(ConnectionError, match="is a symlink"):
            reader.read(TransportEndpoint("shm", link, 4096), 0, 16)
    finally:
        os.unlink(os.path.join(SHM_DIR, link))
        reader.close()
        target.close()


@pytest.fixture
def unregistered(monkeypatch) -> list[str]:
    """Names the resource tracker is told to forget, as the real tracker forgets them."""
    from multiprocessing import resource_tracker

    names: list[str] = []
    real_unregister = resource_tracker.unregister

    def unregister(tracked: str, rtype: str) -> None:
        names.append(tracked)
        real_unregister(tracked, rtype)

    monkeypatch.setattr(resource_tracker, "unregister", unregister)
    return names


@pytest.mark.parametrize("step", ["register", "frombuffer"])
def test_an_interrupt_while_creating_a_segment_leaves_nothing(monkeypatch, step, unregistered):
    """Ctrl-C as the segment is made, at its first step after the O_EXCL open (registering
    it with the resource tracker) or its last (the tensor over the mapping): the segment is
    gone at once, and the tracker no longer names it."""
    from multiprocessing import resource_tracker

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    name = f"qaic_kv_test_int_{step}_{os.getpid()}"
    if step == "register":
        monkeypatch.setattr(resource_tracker, "register", interrupted)
    else:
        monkeypatch.setattr(torch, "frombuffer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        create_transport("shm", name, 4096, 5.0)
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert unregistered == ([] if step == "register" else ["/" + name])


def _resident_kib(path: str) -> int:
    """This process's resident KiB of its mapping of ``path`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith(path))
    return next(int(x.split()[1]) for x in lines[at + 1 :] if x.startswith("Rss:"))


def test_staging_is_faulted_in_at_creation():
    """Every page of a new staging segment is resident before the first save writes it
    (a first write into a fresh page costs many times the copy)."""
    name = f"qaic_kv_test_resident_{os.getpid()}"
    t = create_transport("shm", name, 8 << 20, 5.0)
    try:
        assert _resident_kib(os.path.join(SHM_DIR, name)) == 8 << 10
    finally:
        t.close()


def test_staging_larger_than_dev_shm_is_a_clear_error_at_creation(unregistered):
    """/dev/shm cannot hold the segment (a container's small default): creation fails
    naming the segment, the space and the setting to change, and leaves nothing behind
    (no file, no resource-tracker entry), instead of a SIGBUS in the save that first
    writes past what is free."""
    fs = os.statvfs(SHM_DIR)
    too_big = fs.f_blocks * fs.f_frsize + (1 << 30)  # tmpfs refuses it before taking a page
    name = f"qaic_kv_test_too_big_{os.getpid()}"
    with pytest.raises(OSError, match=r"cannot reserve .* MiB free.*staging_bytes") as err:
        create_transport("shm", name, too_big, 5.0)
    assert name in str(err.value)
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert unregistered == ["/" + name]


def test_transports_are_found_by_kind_and_a_subclass_without_one_replaces_none():
    """create_transport finds a transport by its module and kind alone; an unknown kind is
    named; a subclass that names no kind (a wrapper) does not displace the transport."""
    from vllm_qaic_connector.transports.shm import ShmTransport

    class Wrapped(ShmTransport):
        pass

    name = f"qaic_kv_kinds{os.getpid()}_r0_{'ab' * 8}"
    transport = create_transport("shm", name, 4096, 1.0)
    try:
        assert type(transport) is ShmTransport and transport.endpoint().address == name
    finally:
        transport.close()
    for unknown in ("rdma", "base", "shared_cache"):
        with pytest.raises(ValueError, match=f"unknown transport {unknown!r}"):
            create_transport(unknown, name, 4096, 1.0)
    assert not os.path.exists(os.path.join(SHM_DIR, name))
