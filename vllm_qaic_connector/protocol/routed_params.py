"""What a router asks of an engine in a request's ``kv_transfer_params`` (`RoutedParams`):
decoded once, where vLLM hands the request to the connector (``on_new_request``), and
encoded by our proxy. The two flags keep vLLM NixlConnector's names, which every P/D router
sends; a decode's ticket (`ticket.RemotePrefill`) travels beside them, read by the decode."""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_qaic_connector.protocol.names import address_problem
from vllm_qaic_connector.protocol.ticket import RemotePrefill


class RoutedParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    # To a prefill: stage this request's KV for a decode, in the format of the decode named
    # here (none named: the format every configured decode takes, else our own), ...
    do_remote_decode: bool = False
    decode_host: str = ""
    decode_port: int = 0
    # ... after loading the kept turn this ticket names, as far as the prompt begins with
    # its tokens (``reuse_turns``; the rest is computed).
    earlier_turn: RemotePrefill | None = None
    # To a decode: load the KV the ticket beside these names (its fields), ...
    do_remote_prefill: bool = False
    # ... or the prefill's reason it staged none: a failed load, for kv_load_failure_policy.
    error: str = ""
    # ... then keep this turn for the conversation's next prefill and answer with its ticket
    # (``reuse_turns``), also given by ``turn_id`` over the side channel while it is held
    # (a streamed answer carries no ticket).
    keep_turn: bool = False
    turn_id: str = ""

    def __post_init__(self) -> None:
        named = self.decode_host or self.decode_port
        if named and (bad := address_problem(self.decode_host, self.decode_port, "decode_")):
            raise ValueError(bad)

    def loaded(self) -> RoutedParams:
        """The same request once its load was handed to the worker: never loaded again (a
        preempted request recomputes, as vLLM's own connectors do)."""
        return msgspec.structs.replace(self, do_remote_prefill=False, error="", earlier_turn=None)


NOT_ROUTED = RoutedParams()


def routed_params(params: dict[str, Any] | None) -> RoutedParams:
    """Raises ValueError naming the field that is wrong. A null counts as not sent (routers
    send NixlConnector's unused fields as nulls)."""
    if params is None:
        return NOT_ROUTED
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    sent = {k: v for k, v in params.items() if v is not None}
    try:
        return msgspec.convert(sent, RoutedParams, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed kv_transfer_params: {exc}") from None
