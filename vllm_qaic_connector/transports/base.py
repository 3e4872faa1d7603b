"""The transport interface: a local staging region peers can read, and reads of theirs."""

from __future__ import annotations

import contextlib
import mmap
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from vllm_qaic_connector.kv.byte_runs import ByteRun
from vllm_qaic_connector.protocol.wire import SharedCache, TransportEndpoint, staging_name

__all__ = ["KVTransport", "staging_name"]


MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap module does not name it


def populate(mapping: mmap.mmap) -> None:
    """Fault in every page of a staging region now, at start-up: a save's first write into
    a fresh page costs ~15x the copy (128 KiB: 90 us against 6 here). A kernel without
    the advice leaves the pages to fault on first use, as before."""
    with contextlib.suppress(OSError):
        mapping.madvise(MADV_POPULATE_WRITE)


class KVTransport(ABC):
    """Moves staged KV bytes from a prefill rank to a decode rank."""

    kind: ClassVar[str]
    kinds: ClassVar[dict[str, type[KVTransport]]] = {}  # every subclass, by its kind

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in vars(cls):  # a subclass that names no kind of its own replaces nothing
            KVTransport.kinds[cls.kind] = cls

    @abstractmethod
    def __init__(
        self, name: str, staging_bytes: int, *, timeout_s: float = 30.0, stages: bool = True
    ) -> None:
        """Create this rank's staging region, named ``name``, of ``staging_bytes`` (none
        where it does not ``stages``); ``timeout_s`` bounds every read."""

    @property
    @abstractmethod
    def staging(self) -> torch.Tensor:
        """This rank's staging region as a writable flat uint8 tensor."""

    @abstractmethod
    def endpoint(self) -> TransportEndpoint:
        """How peers reach the staging region; travels in the handshake."""

    # True when a read can carry a message that the peer receives (`poll_notifications`);
    # otherwise readers acknowledge over the side channel.
    delivers_notifications: ClassVar[bool] = False
    # The config key that lets decodes read a prefill's KV cache directly (`share_kv_cache`).
    direct_reads_key: ClassVar[str]
    # True where `share_kv_cache` and `read_into` take a KV cache in GPU memory too.
    shares_device_memory: bool = False

    def share_kv_cache(self, layers: Sequence[torch.Tensor], produces: bool) -> SharedCache | None:
        """Make vLLM's KV cache (``layers``) readable by peers, or writable by our reads;
        its description travels in the handshake. None where this transport cannot."""
        return None

    def read_into(
        self, peer: TransportEndpoint, runs: Sequence[ByteRun], *, base_offset: int = 0
    ) -> int:
        """Peer region ``[base_offset + run.src, +nbytes)`` straight into local address
        ``run.dst`` (memory shared with `share_kv_cache`), where the transport can."""
        raise ConnectionError(f"the {self.kind} transport cannot read into registered memory")

    @abstractmethod
    def read(
        self, peer: TransportEndpoint, offset: int, nbytes: int, *, notify: bytes | None = None
    ) -> torch.Tensor:
        """Bytes ``[offset, offset+nbytes)`` of a peer's staging region, as a uint8 tensor.

        May be a zero-copy view. Valid until ``release_read`` for the same peer and offset.
        ``notify`` reaches the peer after the bytes, where the transport delivers messages.
        """

    def poll_notifications(self) -> list[bytes]:
        """Messages readers attached to their reads of our staging."""
        return []

    def release_read(self, peer: TransportEndpoint, offset: int) -> None:  # noqa: B027
        """Drop whatever `read` holds for that region."""

    def pin_host_memory(self) -> None:  # noqa: B027
        """Page-lock the staging and every peer mapping from now on, for a GPU's copies
        (where the transport can; its memory stays usable either way)."""

    def forget_peer(self, peer: TransportEndpoint) -> None:  # noqa: B027
        """Drop mappings/registrations held for a peer."""

    @abstractmethod
    def close(self) -> None:
        """Release the staging region and every peer resource. Idempotent."""
