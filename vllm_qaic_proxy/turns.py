"""Multi-turn reuse in the proxy: a decode that keeps turns (``reuse_turns``) answers each
with a ticket for the conversation's KV so far; the proxy keeps it under the conversation
that turn ends, and gives it to the prefill of the request that continues it, once. The
prefill checks that its prompt's tokens begin with exactly the ticket's (else it computes),
so a wrong guess here costs a recompute, never a wrong token.

A conversation is its text: a completion's prompt and answer, or a chat's messages (role and
content) and the answer's. A request continues the longest kept one its text begins with,
of the same client (credentials), model and cache salt. A ticket not taken is released when
it drops out of the store (``MAX_KEPT``), so the decode frees its blocks before the lease.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

from vllm_qaic_proxy import apis
from vllm_qaic_proxy.apis import Api

MAX_KEPT = 1024  # conversations whose next turn may come


def conversation(
    api: Api, body: dict[str, Any], answer: dict[str, Any] | None = None
) -> str | None:
    """The conversation a request (and its ``answer``) makes, as text; None where reuse
    does not apply (another API, a list of prompts, token ids, n > 1)."""
    said = None
    if answer is not None:
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1:
            return None
        said = choices[0].get("text") if api is apis.COMPLETIONS else choices[0].get("message")
    if api is apis.COMPLETIONS and isinstance(body.get("prompt"), str):
        return body["prompt"] + (said if isinstance(said, str) else "")
    if api is apis.CHAT and isinstance(messages := body.get("messages"), list):
        said_list = [said] if isinstance(said, dict) else []
        parts = (m for m in [*messages, *said_list] if isinstance(m, dict))
        return "".join(json.dumps([m.get("role"), m.get("content")]) + "\n" for m in parts)
    return None


def owner(body: dict[str, Any], auth: dict[str, str]) -> str:
    """Whose conversations a request may continue: the same credentials, model and salt."""
    who = [auth.get("Authorization", ""), body.get("model"), body.get("cache_salt")]
    return hashlib.sha256(json.dumps(who).encode()).hexdigest()


class Turns:
    """Kept turns' tickets by (owner, conversation), oldest first; ``enabled``: the
    engines keep turns (``--reuse-turns``), else nothing is asked or kept."""

    def __init__(self, release: Callable[[dict[str, Any]], None], enabled: bool = True) -> None:
        self._kept: dict[tuple[str, str], dict[str, Any]] = {}
        self._release, self.enabled = release, enabled

    def wanted(self, api: Api, body: dict[str, Any]) -> bool:
        """Whether to ask the decode to keep this turn: its ticket would come back to us
        (a whole answer of one choice, not a stream) for a conversation we can tell."""
        one = not body.get("stream") and body.get("n") in (None, 1)
        return self.enabled and one and conversation(api, body) is not None

    def take(self, api: Api, body: dict[str, Any], auth: dict[str, str]) -> dict[str, Any] | None:
        """The ticket of the longest kept conversation this request continues (taken)."""
        if not self.enabled or (text := conversation(api, body)) is None:
            return None
        now = time.time()
        self._kept = {k: t for k, t in self._kept.items() if t.get("expires_at", 0) > now}
        who = owner(body, auth)
        ours = [(w, t) for w, t in self._kept if w == who and text.startswith(t)]
        return self._kept.pop(max(ours, key=lambda k: len(k[1]))) if ours else None

    def keep(
        self, api: Api, body: dict[str, Any], auth: dict[str, str], answer: dict[str, Any]
    ) -> None:
        """Keeps the ticket a decode answered a turn with, if any."""
        ticket = answer.get("kv_transfer_params")
        if not isinstance(ticket, dict) or not ticket.get("do_remote_prefill"):
            return
        if (text := conversation(api, body, answer)) is None:
            self._release(ticket)  # kept for nothing we can continue: free it now
            return
        key = (owner(body, auth), text)
        if (replaced := self._kept.pop(key, None)) is not None:  # the same turn, again
            self._release(replaced)
        self._kept[key] = ticket
        while len(self._kept) > MAX_KEPT:
            self._release(self._kept.pop(next(iter(self._kept))))
