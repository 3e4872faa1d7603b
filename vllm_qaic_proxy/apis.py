"""The APIs the proxy disaggregates, and how each one's prefill leg asks for one token.

vLLM takes ``kv_transfer_params`` on four of its generating APIs and returns the prefill's
ticket in each answer: OpenAI's completions, chat completions and Responses, and Anthropic's
Messages. The legs differ only in the fields that limit the output, so each API is a row
here; the proxy's two legs are the same for all of them. Every other route of vLLM's server
is relayed to a decode as it is (`relayed`), but those that act on one engine of a fleet.

Tickets stay between the proxy and the engines. A ticket is a bearer token for KV in an
engine's memory, so a client never supplies one: every body a client sends, on every route,
loses its ``kv_transfer_params`` (where all of this connector's fields live: ``do_remote_*``,
``keep_turn``, ``turn_id``, ``earlier_turn``, block ids...), also inside ``vllm_xargs``, which
vLLM merges into the same request arguments (`from_client`, `relayed`). And a client never
sees one: a ticket in an answer, whole or in a streamed event (a Responses event's
``response`` too), is null there, as vLLM alone answers (`taken`, `Events`); the proxy reads
it first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TICKET = "kv_transfer_params"
MARK = b'"kv_transfer_params"'  # as the engines write it in an answer


@dataclass(frozen=True, eq=False)  # one of each: compared by identity
class Api:
    """One generating API: its path and what its prefill leg changes."""

    path: str
    limits: tuple[str, ...]  # output-token limits set to 1: the first always, others if sent
    drops: tuple[str, ...] = ()  # options the prefill's one token does not need
    overrides: dict[str, Any] = field(default_factory=dict)
    first_token_from_prefill: bool = False  # where the proxy may splice it in (first_token)

    def prefill_body(self, body: dict[str, Any], decode_kv: str) -> dict[str, Any]:
        """One token, never streamed. A limit vLLM refuses (0, -1, not a number) stays, so
        the client gets vLLM's own 400 naming it rather than an answer."""
        out = {k: v for k, v in body.items() if k not in self.drops}
        out.update(self.overrides, stream=False)
        out.update({k: 1 for k in self.limits if k in body or k == self.limits[0]})
        for key, least in (*((limit, 1) for limit in self.limits), ("min_tokens", 0)):
            value = body.get(key)
            if value is not None and (type(value) is not int or value < least):
                out[key] = value
        params: dict[str, Any] = {"do_remote_decode": True}
        if decode_kv:  # the prefill stages straight into that decode's layout
            host, port = decode_kv.rsplit(":", 1)
            params.update(decode_host=host, decode_port=int(port))
        out["kv_transfer_params"] = params
        return out


# Logprobs and echo ask about tokens the prefill leg does not return to anyone.
COMPLETION_DROPS = (
    "stream_options", "logprobs", "top_logprobs", "logprob_token_ids", "echo", "prompt_logprobs",
)  # fmt: skip
COMPLETIONS = Api(
    "/v1/completions",
    ("max_tokens", "max_completion_tokens"),
    COMPLETION_DROPS,
    {"n": 1, "min_tokens": 0},
    first_token_from_prefill=True,
)
CHAT = Api(
    "/v1/chat/completions",
    ("max_completion_tokens", "max_tokens"),  # vLLM reads the first first
    COMPLETION_DROPS,
    {"n": 1, "min_tokens": 0},
)
# store: the prefill's answer is nobody's to fetch later; background: the ticket is needed now.
RESPONSES = Api("/v1/responses", ("max_output_tokens",), (), {"store": False, "background": False})
MESSAGES = Api("/v1/messages", ("max_tokens",))
GENERATING = {api.path: api for api in (COMPLETIONS, CHAT, RESPONSES, MESSAGES)}

# Routes that act on or report one engine (its state, weights, adapters, profiler, caches,
# metrics): through the proxy they would reach one engine of the fleet, so they go to each
# engine directly. Every other route serves a request on one engine, and a decode answers it.
ONE_ENGINE = frozenset({
    "/sleep", "/wake_up", "/pause", "/resume", "/reset_prefix_cache", "/reset_mm_cache",
    "/reset_encoder_cache", "/release_kv_cache_memory", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/start_profile", "/stop_profile", "/collective_rpc",
    "/update_weights", "/start_weight_update", "/finish_weight_update", "/update_weight_version",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
    "/start_draft_weight_update", "/scale_elastic_ep", "/abort_requests",
    "/inference/v1/abort_requests", "/fault_tolerance/apply", "/metrics",
})  # fmt: skip


def answers_alone(body: dict[str, Any], api: Api) -> str | None:
    """Why the decode alone serves a request (a prefill leg would be wasted or refused), or
    None. Prompt logprobs: vLLM computes such a prompt whole to score it, reading no cache.
    A Responses request that continues a stored one: only the server that stored it knows
    it (and so the decode that answered it is asked, not a prefill)."""
    echoed = api is COMPLETIONS and body.get("echo") and body.get("logprobs") is not None
    if echoed or (api in (COMPLETIONS, CHAT) and body.get("prompt_logprobs") is not None):
        return "prompt logprobs"
    if api is RESPONSES and body.get("previous_response_id"):
        return "previous_response_id"
    return None


def from_client(body: dict[str, Any]) -> dict[str, Any]:
    """A client's request body without the connector's fields (a copy)."""
    out = {k: v for k, v in body.items() if k != TICKET}
    xargs = out.get("vllm_xargs")
    if isinstance(xargs, dict) and TICKET in xargs:
        out["vllm_xargs"] = {k: v for k, v in xargs.items() if k != TICKET}
    return out


def relayed(data: bytes) -> bytes:
    """A relayed request's body, without the connector's fields where it is a JSON object
    (vLLM's ``/inference/v1/generate`` takes ``kv_transfer_params`` too); else as it came."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return data
    if not isinstance(body, dict) or (clean := from_client(body)) == body:
        return data
    return json.dumps(clean).encode()


def taken(answer: Any) -> Any:
    """The ticket an answer (or a streamed event) carries, or None, taken out of it: its
    ``kv_transfer_params``, at its top or in one of its objects, set to null in place."""
    ticket = None
    for part in [answer, *answer.values()] if isinstance(answer, dict) else []:
        if isinstance(part, dict) and part.get(TICKET) is not None:
            ticket, part[TICKET] = ticket or part[TICKET], None
    return ticket


class Events:
    """A stream's bytes on their way to a client, in whole lines as they come, each line's
    ticket taken out (`taken`; the last one in ``ticket``). A JSON answer is one line."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []  # the start of a line not yet ended
        self.ticket: Any = None

    def feed(self, data: bytes) -> bytes:
        if not self._pending and data.endswith(b"\n") and MARK not in data:
            return data  # whole lines, none with a ticket
        *lines, rest = data.split(b"\n")
        if lines:
            lines[0] = b"".join([*self._pending, lines[0]])
            self._pending = []
        if rest:
            self._pending.append(rest)
        return b"".join(self.line(line) + b"\n" for line in lines)

    def end(self) -> bytes:
        """What is left of the stream: its last line, if it did not end in a newline."""
        rest, self._pending = b"".join(self._pending), []
        return self.line(rest)

    def line(self, line: bytes) -> bytes:
        """``line`` (an event's, or a whole JSON answer) without its ticket."""
        if MARK not in line:
            return line
        head = b"data: " if line.startswith(b"data: ") else b""
        payload = line[len(head) :].rstrip()
        try:
            answer = json.loads(payload)
        except (ValueError, RecursionError):
            return line
        if (ticket := taken(answer)) is None:
            return line
        self.ticket = ticket
        return head + json.dumps(answer).encode() + line[len(head) + len(payload) :]
