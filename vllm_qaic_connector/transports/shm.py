"""Host shared memory: the staging region is a POSIX shm segment that peers map.

A decode reads the prefill's staged bytes through its own mapping, so the only copy is
the one into the decode's KV blocks.

A segment's creator holds an exclusive ``flock`` on it for its whole life; the kernel drops
the lock when the process dies, even by SIGKILL. So at start-up a leftover segment of a dead
incarnation can be told from a live one, and only the dead one is reclaimed.

Segments are also registered with Python's multiprocessing resource tracker, a separate
process that unlinks them once every process sharing it is gone: vLLM's default shutdown
(abort, timeout 0) force-kills the worker right after SIGTERM, before any cleanup of ours.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import warnings
from collections.abc import Sequence
from multiprocessing import resource_tracker

import torch

from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol.wire import SharedCache, TransportEndpoint
from vllm_qaic_connector.transports import host_pinning
from vllm_qaic_connector.transports.base import KVTransport, populate
from vllm_qaic_connector.transports.shared_cache import backing, described, host_identity

SHM_DIR = "/dev/shm"  # where Linux keeps shm_open() objects
logger = get_logger(__name__)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def reclaim_dead_segments(prefix: str) -> None:
    """Unlinks segments named ``prefix*`` whose creator is gone."""
    reclaimed = []
    for name in [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]:
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its creator is alive
        finally:
            os.close(fd)
        _unlink(os.path.join(SHM_DIR, name))
        reclaimed.append(name)
    if reclaimed:
        logger.warning("reclaimed shm segments of dead engines: %s", reclaimed)


def _reserve(fd: int, name: str, size: int) -> None:
    """Takes the segment's pages from /dev/shm now: where it is too small (a container's
    64 MiB default), start-up fails with this error instead of a SIGBUS in the first
    save that writes past what is free."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        free = os.statvfs(SHM_DIR)
        raise OSError(
            exc.errno,
            f"shm segment {name!r}: cannot reserve {size >> 20} MiB in {SHM_DIR} "
            f"({free.f_bavail * free.f_frsize >> 20} MiB free): {exc.strerror}; raise its "
            "size (docker: --shm-size) or lower staging_bytes",
        ) from None


class SharedSegment:
    """One mapped POSIX shm object; the creator unlinks it on close."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        if "/" in name or not name:
            raise ValueError(f"invalid shm segment name {name!r}")
        self.name, self.size, self._owner = name, size, create
        self._closed = self._pinned = False
        path = os.path.join(SHM_DIR, name)
        # A peer's segment is only read: mapped read-only, a bug or a hostile name cannot
        # write into it. O_NOFOLLOW: a symlink planted in /dev/shm is refused, not followed.
        access = os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDONLY
        try:
            fd = os.open(path, access | os.O_NOFOLLOW, 0o600)  # 0600: only our user maps it
        except FileNotFoundError:
            raise ConnectionError(f"shm segment {name!r} does not exist (peer gone?)") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ConnectionError(f"shm segment {name!r} is a symlink: refused") from None
            raise
        self._lock_fd, tracked = -1, False
        try:
            if create:
                # First: an interrupt at any later point leaves the segment to the unlink
                # below or, once we return, to the tracker; never behind.
                resource_tracker.register("/" + name, "shared_memory")
                tracked = True
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "alive" for reclaim checks
                os.ftruncate(fd, size)
                _reserve(fd, name, size)
            elif os.fstat(fd).st_size < size:
                raise ConnectionError(f"shm segment {name!r} is smaller than advertised")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
            if create:
                populate(self._map)
            with warnings.catch_warnings():
                # torch warns that its tensor of a read-only buffer is not write-protected;
                # here the mapping is: a stray write faults in this process, never the peer.
                warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
                self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            if create:
                os.unlink(path)
            if tracked:
                resource_tracker.unregister("/" + name, "shared_memory")
            raise
        if create:
            self._lock_fd = fd  # kept open: closing it would drop the lock
        else:
            os.close(fd)

    def pin(self) -> None:
        """Page-locked for a GPU's copies, until `close`."""
        if not self._pinned and not self._closed:
            self._pinned = host_pinning.pin(self.tensor, read_only=not self._owner)

    def close(self) -> None:
        # Never munmap here: torch views of the mapping may still be alive, and touching
        # them after munmap crashes the process. Dropping our references lets the mapping
        # go with its last view.
        if self._closed:
            return
        self._closed = True
        if self._pinned:
            host_pinning.unpin(self.tensor)
        del self.tensor, self._map
        if self._owner:
            _unlink(os.path.join(SHM_DIR, self.name))
            resource_tracker.unregister("/" + self.name, "shared_memory")
            os.close(self._lock_fd)


def move_into_shm(layers: Sequence[torch.Tensor]) -> SharedCache | None:
    """Moves the storage behind ``layers`` into shared memory, in place (see `backing`):
    vLLM's kernels write there from then on, and decodes map it read-only."""
    whole = backing(layers)
    if whole is None or whole.device.type != "cpu":
        return None
    shm = os.statvfs(SHM_DIR)
    if shm.f_bavail * shm.f_frsize < 2 * whole.numel():  # tmpfs past its size: SIGBUS
        logger.warning("QAICConnector: %s has room for less than twice the KV cache (%d MiB); "
                       "handoffs stage instead of reading the cache directly", SHM_DIR,
                       whole.numel() >> 20)  # fmt: skip
        return None
    # torch.multiprocessing's own move: a new unlinked shm object, the bytes copied over,
    # then the storage's data pointer replaced. It dies with the last process mapping it.
    fd, size = whole.untyped_storage()._share_fd_cpu_()
    path, inode = f"/proc/{os.getpid()}/fd/{fd}", os.fstat(fd).st_ino
    return described(layers, size, path=path, inode=inode, host=host_identity())


class ShmTransport(KVTransport):
    kind = "shm"
    direct_reads_key = "direct_reads"

    def __init__(
        self, name: str, staging_bytes: int, *, timeout_s: float = 0.0, stages: bool = True
    ) -> None:
        """A name ending in ``_<incarnation>``: dead siblings (other incarnations) go first.
        An engine that only loads (``stages`` False, or ``staging_bytes`` 0) maps its
        peers' segments and has none of its own, so none can outlive it when vLLM
        force-kills its worker. Reads are local copies: ``timeout_s`` bounds nothing."""
        reclaim_dead_segments(name.rpartition("_")[0] + "_")
        own = stages and staging_bytes > 0
        self._own = SharedSegment(name, staging_bytes, create=True) if own else None
        self._peers: dict[str, SharedSegment] = {}
        self._lock = threading.Lock()  # loads run on several threads
        self._pin = False

    def pin_host_memory(self) -> None:
        with self._lock:
            self._pin = True
            for seg in filter(None, [self._own, *self._peers.values()]):
                seg.pin()

    @property
    def staging(self) -> torch.Tensor:
        return self._own.tensor if self._own else torch.empty(0, dtype=torch.uint8)

    def endpoint(self) -> TransportEndpoint:
        name, size = (self._own.name, self._own.size) if self._own else ("", 0)  # loads only
        return TransportEndpoint(self.kind, name, size)

    def read(
        self, peer: TransportEndpoint, offset: int, nbytes: int, *, notify: bytes | None = None
    ) -> torch.Tensor:
        if peer.kind != self.kind:
            raise ConnectionError(f"peer uses transport {peer.kind!r}, we use {self.kind!r}")
        if offset < 0 or offset + nbytes > peer.size:
            raise ValueError(f"read [{offset}, {offset + nbytes}) outside segment {peer.address}")
        with self._lock:
            if peer.address not in self._peers:
                self._peers[peer.address] = SharedSegment(peer.address, peer.size, create=False)
                if self._pin:
                    self._peers[peer.address].pin()
            return self._peers[peer.address].tensor[offset : offset + nbytes]

    def forget_peer(self, peer: TransportEndpoint) -> None:
        with self._lock:
            seg = self._peers.pop(peer.address, None)
        if seg is not None:
            seg.close()

    def share_kv_cache(self, layers: Sequence[torch.Tensor], produces: bool) -> SharedCache | None:
        """Only a rank that saves has a cache worth reading (`move_into_shm`)."""
        return move_into_shm(layers) if produces else None

    def close(self) -> None:
        with self._lock:
            for seg in filter(None, [*self._peers.values(), self._own]):
                seg.close()
            self._peers.clear()
