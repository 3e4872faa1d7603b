"""A ``/v1/completions`` request with a list of prompts, handed off one prompt at a time.

vLLM runs each prompt of a list as its own request, but answers with one
``kv_transfer_params``: the first prompt's. A decode given the whole list with that ticket
would load one prompt and fail the others' checks. So the proxy sends each prompt through
its own prefill and decode legs and puts the answers back together as vLLM would have
answered the list: each prompt's n choices, prompt by prompt, and usage summed over them.
"""

from __future__ import annotations

from typing import Any

USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def prompts(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a request that holds several (texts or token-id lists), else None."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    return prompt if all(isinstance(p, (str, list)) for p in prompt) else None


def merged(answers: list[tuple[int, dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
    """One answer for the list, from each prompt's (status, body) in prompt order; the
    first failure is the list's answer, as vLLM fails a list on any prompt's error."""
    for status, answer in answers:
        if status != 200:
            return status, answer
    ordered = (
        choice
        for _, answer in answers
        for choice in sorted(answer.get("choices") or (), key=lambda c: c.get("index", 0))
    )  # prompt by prompt, each prompt's n choices in order
    choices = [{**choice, "index": i} for i, choice in enumerate(ordered)]
    first = answers[0][1]
    usage = first.get("usage")
    if isinstance(usage, dict):  # the counts summed, the rest (details) as vLLM gave them
        usage = dict(usage)
        for name in USAGE_COUNTS:
            counts = [(a.get("usage") or {}).get(name) for _, a in answers]
            if all(isinstance(n, int) for n in counts):
                usage[name] = sum(counts)
    return 200, {**first, "choices": choices, "usage": usage}
