"""One ticket, several requests: vLLM runs a request for n > 1 choices as n requests with
the same ``kv_transfer_params``. The first read of a ticket frees its staging on the
prefill, so a second read of it fails. Here one of them loads and the others wait for it
(vLLM asks again next step), then take its blocks from the prefix cache and compute the
rest: one read per ticket, and no failed load. Pure bookkeeping: no I/O, no threads."""

from __future__ import annotations

from collections import OrderedDict

from vllm_qaic_connector.protocol.ticket import RemotePrefill

TicketKey = tuple[str, str, str, int]
REMEMBERED = 4096  # tickets read: only a sibling that arrives late asks for one again


def ticket_key(remote: RemotePrefill) -> TicketKey:
    return remote.remote_engine_id, remote.incarnation, remote.remote_request_id, remote.generation


class SharedTickets:
    def __init__(self, prefix_caching: bool = True) -> None:
        # Without a prefix cache, one that waited for another's read would recompute the
        # whole prompt: each reads the ticket then, while the staging holds.
        self._share = prefix_caching
        self._loader: dict[TicketKey, str] = {}  # the request loading each ticket
        self._held: dict[str, TicketKey] = {}  # and back
        self._read: OrderedDict[TicketKey, None] = OrderedDict()

    def state(self, key: TicketKey, request_id: str) -> str:
        """``free`` (this request may load it), ``busy`` (another is loading it) or
        ``read`` (another loaded it, or gave it up: it is spent)."""
        if key in self._read:
            return "read"
        return "busy" if self._loader.get(key, request_id) != request_id else "free"

    def hold(self, request_id: str, key: TicketKey) -> None:
        if self._share:
            self._loader[key], self._held[request_id] = request_id, key

    def leave(self, request_id: str, spent: bool = True) -> None:
        """The request's load is over (done, failed or aborted: its ticket is spent), or
        it loads nothing after all (``spent`` False: a sibling may still load it)."""
        if (key := self._held.pop(request_id, None)) is None:
            return
        del self._loader[key]
        if spent:
            self._read[key] = None
            if len(self._read) > REMEMBERED:
                self._read.popitem(last=False)
