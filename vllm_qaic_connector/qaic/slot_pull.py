"""A QAIC decode target fed over NIXL: staged KV lands straight in batch slot k.

The target's KV buffers (the regex-selected, prefix-named ones; never vision buffers) are
registered with the decode's NIXL agent, which the handshake advertises with layout
``qaic_slot``. The prefill stages a request as one slot-shaped block, so a pull is one NIXL
transfer whose descriptors land on ``[k, h, 0:n, :]`` of each layer's K and V buffer: the
READ is the DMA, with no receive buffer and no host copy, and other slots are never written.
"""

from __future__ import annotations

from itertools import chain

from vllm_qaic_connector.kv.byte_runs import ByteRun, plan_slot_reads
from vllm_qaic_connector.layout import KVGeometry
from vllm_qaic_connector.protocol.ticket import UNBOUND
from vllm_qaic_connector.protocol.wire import TransportEndpoint
from vllm_qaic_connector.qaic.target import SlotTarget
from vllm_qaic_connector.region_headers import HEADER_BYTES, checked_read
from vllm_qaic_connector.transports.nixl import NixlTransport


class SlotPuller:
    """Registers a SlotTarget's KV buffers with a NIXL transport for as long as it lives."""

    def __init__(self, target: SlotTarget, transport: NixlTransport) -> None:
        self.target, self.transport = target, transport
        self._buffers = [target.kv(layer) for layer in range(target.num_layers)]
        try:
            for buffer in chain.from_iterable(self._buffers):
                transport.register_destination(buffer)
        except BaseException:
            self.close()
            raise

    def pull(
        self, slot: int, peer: TransportEndpoint, staging_offset: int, geo: KVGeometry,
        num_tokens: int, generation: int, notify: bytes | None = None, binding: bytes = UNBOUND,
    ) -> list[ByteRun]:  # fmt: skip
        """READ tokens ``[0, num_tokens)`` of a request staged at ``staging_offset`` into
        ``slot``; returns the runs read (one NIXL descriptor each). StaleTicket if the
        region's header did not hold ``generation`` and ``binding`` before and ``generation``
        after (the slot then holds garbage: its owner frees it)."""
        if geo != self.target.geometry:
            raise ValueError(f"staged geometry {geo} is not a slot of this target")
        self.target.check_writable(slot, num_tokens)
        addresses = [(k.data_ptr(), v.data_ptr()) for k, v in self._buffers]
        runs = plan_slot_reads(geo, num_tokens, slot, addresses)
        with checked_read(self.transport, peer, staging_offset, 0, generation, notify, binding):
            self.transport.read_into(peer, runs, base_offset=staging_offset + HEADER_BYTES)
        return runs

    def close(self) -> None:
        for buffer in chain.from_iterable(self._buffers):
            self.transport.deregister_destination(buffer)
        self._buffers = []
