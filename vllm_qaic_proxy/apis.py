"""The APIs the proxy disaggregates, and how each one's prefill leg asks for one token.

vLLM takes ``kv_transfer_params`` on four of its generating APIs and returns the prefill's
ticket in each answer: OpenAI's completions, chat completions and Responses, and Anthropic's
Messages. The legs differ only in the fields that limit the output, so each API is a row
here; the proxy's two legs are the same for all of them. Every other route of vLLM's server
is relayed to a decode as it is (`relayed`), but those that act on one engine of a fleet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
