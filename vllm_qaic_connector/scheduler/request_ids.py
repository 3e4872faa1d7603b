"""What vLLM's own request ids say about a request that no ``kv_transfer_params`` can:
whether it is one of several that a single HTTP request became, of which only one ticket
goes back to the client. Pure: ids in, facts out."""

from __future__ import annotations

import re

# n > 1: vLLM runs n requests named "<index>_<parent id>" (`parallel_sampling.get_child_info`).
_SAMPLING_CHILD = re.compile(r"\d+_")
# A /v1/completions prompt list: prompt i is "cmpl-<base>-<i>" (the completion server), to
# which the engine appends "-" and 8 random characters (`InputProcessor`).
_LIST_PROMPT = re.compile(r"cmpl-.+-(\d+)-[0-9a-f]{8}")


def sampling_child(request_id: str) -> bool:
    return _SAMPLING_CHILD.match(request_id) is not None


def later_prompt_of_a_list(request_id: str) -> int | None:
    """The prompt's position when it is not the first of a completions prompt list, else
    None. vLLM answers a list with the first prompt's ``kv_transfer_params`` only."""
    found = _LIST_PROMPT.fullmatch(request_id)
    position = int(found.group(1)) if found else 0
    return position or None
