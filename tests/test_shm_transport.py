"""The shm transport between two real processes, over real POSIX shared memory."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os

import pytest
import torch

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
        from vllm_qaic_connector.wire import TransportEndpoint

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
