"""Host shared memory: the staging region is a POSIX shm segment that peers map.

A decode reads the prefill's staged bytes through its own mapping, so the only copy is
the one into the decode's KV blocks.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

from vllm_qaic_connector.transports.base import KVTransport
from vllm_qaic_connector.wire import TransportEndpoint

SHM_DIR = "/dev/shm"  # where Linux keeps shm_open() objects


class SharedSegment:
    """One mapped POSIX shm object; the creator unlinks it on close."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        if "/" in name or not name:
            raise ValueError(f"invalid shm segment name {name!r}")
        self.name, self.size, self._owner = name, size, create
        self._closed = False
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            raise ConnectionError(f"shm segment {name!r} does not exist (peer gone?)") from None
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ConnectionError(f"shm segment {name!r} is smaller than advertised")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                os.unlink(path)
            raise
        os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        # Never munmap here: torch views of the mapping may still be alive, and touching
        # them after munmap crashes the process. Dropping our references lets the mapping
        # go with its last view.
        if self._closed:
            return
        self._closed = True
        del self.tensor, self._map
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))


class ShmTransport(KVTransport):
    kind = "shm"

    def __init__(self, name: str, staging_bytes: int) -> None:
        self._own = SharedSegment(name, staging_bytes, create=True)
        self._peers: dict[str, SharedSegment] = {}

    @property
    def staging(self) -> torch.Tensor:
        return self._own.tensor

    def endpoint(self) -> TransportEndpoint:
        return TransportEndpoint(self.kind, self._own.name, self._own.size)

    def read(
        self, peer: TransportEndpoint, offset: int, nbytes: int, *, notify: bytes | None = None
    ) -> torch.Tensor:
        if peer.kind != self.kind:
            raise ConnectionError(f"peer uses transport {peer.kind!r}, we use {self.kind!r}")
        if offset < 0 or offset + nbytes > peer.size:
            raise ValueError(f"read [{offset}, {offset + nbytes}) outside segment {peer.address}")
        seg = self._peers.get(peer.address)
        if seg is None:
            seg = self._peers[peer.address] = SharedSegment(peer.address, peer.size, create=False)
        return seg.tensor[offset : offset + nbytes]

    def forget_peer(self, peer: TransportEndpoint) -> None:
        seg = self._peers.pop(peer.address, None)
        if seg is not None:
            seg.close()

    def close(self) -> None:
        for seg in self._peers.values():
            seg.close()
        self._peers.clear()
        self._own.close()
