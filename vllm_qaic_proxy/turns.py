"""Multi-turn reuse in the proxy: a decode that keeps turns (``reuse_turns``) hands out a
ticket for each turn's KV (in a whole answer; a stream's, from its side channel); the proxy
keeps it under the turn's request, and gives it to the prefill of the request that
continues it, once. The prefill checks its prompt's tokens against the ticket's (else it
computes), so a wrong guess here costs a recompute, never a wrong token.

A request is known by its text: a completion's prompt, or the messages (role and content)
of a chat, of Anthropic's Messages or of a Responses request's input; not the answer's,
which a stream would have to be parsed for. A request continues the longest kept one its
text begins with, of the same client (credentials), model and cache salt. A ticket not
taken is released when it drops out of the store (``MAX_KEPT``), so the decode frees its
blocks before the lease.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from vllm_qaic_proxy import apis
from vllm_qaic_proxy.apis import Api

MAX_KEPT = 1024  # conversations whose next turn may come


def conversation(api: Api, body: dict[str, Any]) -> str | None:
    """The conversation a request continues, as text; None where reuse does not apply
    (another API, a list of prompts, token ids, n > 1)."""
    if body.get("n") not in (None, 1):
        return None
    if api is apis.COMPLETIONS and isinstance(body.get("prompt"), str):
        return body["prompt"]
    # Chat and Messages send the history as messages, Responses as input items (a Responses
    # request that names a stored one instead is the decode's alone: `apis.answers_alone`).
    history = body.get("input" if api is apis.RESPONSES else "messages")
    if api is not apis.COMPLETIONS and isinstance(history, list):
        system = {"role": "system", "content": body.get("system") or body.get("instructions")}
        parts = (m for m in [system, *history] if isinstance(m, dict))
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

    def asked(self, api: Api, body: dict[str, Any], decode_kv: str) -> str | None:
        """A fresh name to ask the decode to keep this turn as (``keep_turn``), or None. Its
        ticket comes in a whole answer; a stream's (which carries none) from the decode's
        side channel ``decode_kv``, so without one a stream's turn is not asked."""
        kept = self.enabled and conversation(api, body) is not None
        return secrets.token_hex(16) if kept and (decode_kv or not body.get("stream")) else None

    def take(self, api: Api, body: dict[str, Any], auth: dict[str, str]) -> dict[str, Any] | None:
        """The ticket of the longest kept conversation this request continues (taken)."""
        if not self.enabled or (text := conversation(api, body)) is None:
            return None
        now = time.time()
        self._kept = {k: t for k, t in self._kept.items() if t.get("expires_at", 0) > now}
        who = owner(body, auth)
        ours = [(w, t) for w, t in self._kept if w == who and text.startswith(t)]
        return self._kept.pop(max(ours, key=lambda k: len(k[1]))) if ours else None

    def keep(self, api: Api, body: dict[str, Any], auth: dict[str, str], ticket: Any) -> None:
        """Keeps the ticket of the turn a decode kept for this request, if any."""
        if not isinstance(ticket, dict) or not ticket.get("do_remote_prefill"):
            return
        if (text := conversation(api, body)) is None:
            self._release(ticket)  # kept for nothing we can continue: free it now
            return
        key = (owner(body, auth), text)
        if (replaced := self._kept.pop(key, None)) is not None:  # the same turn, again
            self._release(replaced)
        self._kept[key] = ticket
        while len(self._kept) > MAX_KEPT:
            self._release(self._kept.pop(next(iter(self._kept))))
