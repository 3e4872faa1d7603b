"""The client's first token comes from the prefill.

The prefill samples one token anyway. When the decode continues from it (its prompt is the
prompt's token ids and that token), the client has it as soon as the prefill answers: the KV
transfer and the decode's first step leave the time to first token, and the decode computes
that token's KV instead of recomputing the prompt's last one.

Only for what a decode can continue exactly: a ``/v1/completions`` request whose options do
not look back over the output (stop strings, penalties, grammars...) and a prefill
whose ticket names the tokens it staged (this connector's; vLLM's NixlConnector loads the
decode's whole prompt, so it keeps the decode's own first token), all of the prompt's (a
model with Mamba layers stages one short, and its decode steps the last prompt token itself:
vLLM's CPU scan of that token and the next together agreed with none of the aggregated
answers).

And only where the text is exact. vLLM detokenizes incrementally (`DecodeStream`): a token
whose bytes are not whole UTF-8 text is held back, or shown as U+FFFD, until later tokens
complete it, and a decode primed with a prompt that ends in such a token restarts its text
elsewhere. So a prefill's token whose text is empty or holds U+FFFD is not the client's: the
decode computes its own first token, as the aggregated server would (never a guess).
Likewise where the answer's randomness or spacing carries state across the first token (a
seeded sampler, no spaces between special tokens).

Logprobs asked of the answer come from both legs, the first token's from the prefill: vLLM
alone computes that token inside the prompt's pass, as the prefill does, where a decode
computes it in a decode step over loaded KV (vLLM's MLA kernels put the two up to 0.17
apart: testbed/kernel_gap.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm_qaic_connector.protocol.ticket import RemotePrefill, parse_remote_prefill

# Options whose meaning spans the first token (the decode alone would apply them to the
# rest only) or that the answer would have to merge across the legs. Every field of vLLM's
# request is either here or known to continue exactly (tests/unit/test_first_token_text.py
# fails on a field vLLM adds until it is sorted).
SPANNING = (
    "echo", "logprob_token_ids", "prompt_logprobs", "suffix", "stop", "bad_words",
    "min_tokens", "frequency_penalty", "presence_penalty", "repetition_detection",
    "thinking_token_budget", "response_format", "structured_outputs", "use_beam_search",
    "prompt_embeds", "mm_payload", "return_mm_kwargs", "ec_transfer_params",
    "return_tokens_as_token_ids", "return_token_offsets", "routed_experts_prompt_start",
    "watermarking", "vllm_xargs",
)  # fmt: skip
# Where 0 asks for something (the sampled token's logprob alone); for the rest of SPANNING
# 0, False, "" and empty lists and objects are vLLM's "off".
ZERO_ASKS = ("logprobs", "prompt_logprobs", "top_logprobs")
MERGED = ("logprobs",)  # asked of the prefill's token too; the answer joins both legs' lists
UNSURE_TEXT = "\ufffd"  # the detokenizer's mark for bytes that are not (yet) whole text
DEFAULT_MAX_TOKENS = 16  # vLLM's, for /v1/completions
# The fields of vLLM's streamed completion chunks, besides choices (and usage, at the end).
STREAM_HEAD = ("id", "object", "created", "model")


def eligible(body: dict[str, Any]) -> bool:
    """Whether the prefill's token can be the answer's first."""
    prompt = body.get("prompt")
    one_prompt = isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    )
    seeded = body.get("seed") is not None and body.get("temperature", 1.0) != 0
    carried = seeded or body.get("spaces_between_special_tokens") is False  # across it
    streamed_ids = body.get("return_token_ids") and body.get("stream")
    several = body.get("n") not in (None, 1)  # one prefill token, n answers to start
    unsure = carried or streamed_ids or several
    return one_prompt and not (unsure or any(asks(body, field) for field in SPANNING))


def asks(body: dict[str, Any], field: str) -> bool:
    """Whether ``body`` turns ``field`` on (``logprobs: 0`` does; ``stop: []`` does not)."""
    value = body.get(field)
    return value is not None and value is not False and (field in ZERO_ASKS or bool(value))


@dataclass(frozen=True)
class FirstToken:
    """The prefill's answer, as the start of the client's."""

    answer: dict[str, Any]  # the prefill's, without its kv_transfer_params
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finished: bool  # the whole answer: a stop, or a limit of one token
    limit: int  # the answer's most tokens, as vLLM bounds it (the context apart)

    @classmethod
    def of(
        cls, prefilled: dict[str, Any], body: dict[str, Any], context: int | None = None
    ) -> FirstToken | None:
        """None where the prefill's answer does not allow it (another connector's ticket,
        no token ids): then the decode answers from its own first token. ``context``: the
        decode's max_model_len, where known; a prompt one token short of it ends the answer
        at the prefill's token, as vLLM ends it (the decode would refuse the prompt and
        that token as longer than its context)."""
        params = prefilled.get("kv_transfer_params")
        try:
            [choice] = prefilled["choices"]
            prompt_ids, ids = choice["prompt_token_ids"], choice["token_ids"]
            ticket = parse_remote_prefill(params if isinstance(params, dict) else {})
        except (KeyError, TypeError, ValueError):
            return None
        one = isinstance(prompt_ids, list) and isinstance(ids, list) and len(ids) == 1
        # Not all of the prompt staged (a recurrent state): the decode scans the last token.
        if not one or ticket.num_tokens != len(prompt_ids):
            return None
        limit = answer_limit(body, ticket)
        finished = choice.get("finish_reason") == "stop" or limit <= 1
        finished |= context is not None and len(prompt_ids) + 1 >= context
        text = choice.get("text") or ""
        if not finished and (not text or UNSURE_TEXT in text):
            return None  # its text depends on the tokens after it: the decode's own
        shown = {**choice, "prompt_token_ids": None, "token_ids": None}  # as vLLM's, unasked
        answer = {k: v for k, v in prefilled.items() if k != "kv_transfer_params"}
        answer["choices"] = [shown]  # a copy: the prefill's answer is left as it came
        if body.get("return_token_ids"):
            shown.update(prompt_token_ids=prompt_ids, token_ids=ids)
        return cls(answer, text, prompt_ids, ids, finished, limit)

    @property
    def logprobs(self) -> Any:
        return self.answer["choices"][0].get("logprobs")

    @property
    def shift(self) -> int:
        """How far the decode's text offsets move: vLLM counts them from the answer's start,
        token by token, and the decode's answer starts after the first token."""
        first = self.logprobs
        return first["text_offset"][-1] + len(first["tokens"][-1]) if first else 0

    def decode_body(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """The decode leg: the prompt and the first token as token ids, one token fewer."""
        out = {k: v for k, v in body.items() if k != "truncate_prompt_tokens"}
        out.update(
            prompt=self.prompt_token_ids + self.token_ids,
            max_tokens=self.limit - 1,
            request_id=self.answer["id"].removeprefix("cmpl-"),  # its events: the same id
            kv_transfer_params=params,
        )
        return out

    def joined(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The decode's whole answer, with the first token put back in front."""
        choice = answer["choices"][0]
        choice["text"] = self.text + (choice.get("text") or "")
        if self.logprobs and (rest := shifted(choice.get("logprobs"), self.shift)):
            choice["logprobs"] = {k: v + rest[k] for k, v in self.logprobs.items()}
        if choice.get("token_ids") is not None:  # asked for: the prompt is the prefill's
            choice.update(
                prompt_token_ids=self.prompt_token_ids,
                token_ids=self.token_ids + (choice["token_ids"] or []),
            )
        answer["usage"] = fix_usage(answer.get("usage"))
        return answer

    def events(self, options: Any, final_usage: bool = True) -> bytes:
        """The first token as a streamed event (with the request's ``stream_options``); the
        whole stream when the prefill finished. ``final_usage``: the usage event at the end
        is ours to send (the decode sends its own otherwise)."""
        head = {k: self.answer[k] for k in STREAM_HEAD if k in self.answer}
        ended = self.answer["choices"][0] if self.finished else {}
        choice = {
            "index": 0, "text": self.text, "logprobs": self.logprobs,
            "finish_reason": ended.get("finish_reason"), "stop_reason": ended.get("stop_reason"),
            "prompt_token_ids": None, "token_ids": None,
        }  # fmt: skip
        options = options if isinstance(options, dict) else {}
        usage = self.answer.get("usage") or {}
        counts = {k: v for k, v in usage.items() if v is not None}  # as vLLM streams it
        chunk = {**head, "choices": [choice]}
        if options.get("include_usage") and options.get("continuous_usage_stats"):
            chunk["usage"] = counts  # on every event: here, one token so far
        out = [chunk]
        if self.finished and final_usage and options.get("include_usage"):
            out.append({**head, "choices": [], "usage": counts})
        data = b"".join(event(c) for c in out)
        return data + b"data: [DONE]\n\n" if self.finished else data


def answer_limit(body: dict[str, Any], ticket: RemotePrefill) -> int:
    """The most tokens vLLM answers a completion with, the context apart (its
    ``get_max_tokens``): the client's max_tokens (absent or null: 16, vLLM's completions
    default), never past the server's generation-config cap (the prefill's, in its ticket)."""
    asked = body.get("max_tokens")
    asked = DEFAULT_MAX_TOKENS if asked is None else asked
    return asked if ticket.max_tokens_cap is None else min(asked, ticket.max_tokens_cap)


def event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def fix_usage(usage: Any) -> Any:
    """The decode counted the first token as prompt: it is the answer's."""
    if not isinstance(usage, dict) or "prompt_tokens" not in usage:
        return usage
    prompt, completion = usage["prompt_tokens"] - 1, usage.get("completion_tokens", 0) + 1
    return {**usage, "prompt_tokens": prompt, "completion_tokens": completion}


def shifted(logprobs: Any, shift: int) -> Any:
    """Completion ``logprobs`` with their text offsets ``shift`` characters on."""
    if not isinstance(logprobs, dict) or not shift:
        return logprobs
    return {**logprobs, "text_offset": [o + shift for o in logprobs["text_offset"]]}


def fix_event(line: bytes, shift: int = 0) -> bytes:
    """One line of the decode's stream, its usage (if any) recounted and its logprobs' text
    offsets ``shift`` characters on (past the first token)."""
    usage = b'"usage":{' in line or b'"usage": {' in line
    if not line.startswith(b"data: {") or not (usage or (shift and b'"text_offset"' in line)):
        return line
    payload = json.loads(line[6:])
    if usage:
        payload["usage"] = fix_usage(payload.get("usage"))
    for choice in payload.get("choices") or ():
        if "logprobs" in choice:
            choice["logprobs"] = shifted(choice["logprobs"], shift)
    return f"data: {json.dumps(payload)}\n".encode()
