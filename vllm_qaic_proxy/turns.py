"""Multi-turn reuse in the proxy: a decode that keeps turns (``reuse_turns``) hands out a
ticket for each turn's KV (in a whole answer; a stream's, from its side channel); the proxy
keeps it under the turn's request, and gives it to the prefill of the request that
continues it, once. The prefill checks its prompt's tokens against the ticket's (else it
computes), so a wrong guess here costs a recompute, never a wrong token.

A request is known by its text: a completion's prompt, or the messages (role and content)
of a chat, of Anthropic's Messages or of a Responses request's input; not the answer's,
which a stream would have to be parsed for. A request continues the longest kept one its
text begins with, of the same client, model and cache salt. A client is its credentials
(``Authorization``), or, sending none, the address it connects from: anonymous clients
neither take nor flush each other's turns.

The store is bounded: at most ``MAX_KEPT`` turns and ``MAX_KEPT_BYTES`` bytes, counting
each turn's conversation text (UTF-8) and its ticket (as JSON). Past either bound, the
oldest turn of the client that holds the most bytes is released (the decode frees its
blocks before the lease), so a client that floods the store drops its own turns, not
others'. A turn whose decode is marked down (`routing`) is dropped when it would be taken:
the next turn computes rather than wait on a dead peer (the decode's lease frees it).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_qaic_proxy import apis
from vllm_qaic_proxy.apis import Api

MAX_KEPT = 1024  # conversations whose next turn may come
MAX_KEPT_BYTES = 256 << 20  # their texts and tickets


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


def client(auth: dict[str, str], peer: str | None) -> str:
    """Who sends a request: its credentials, or where an anonymous client connects from."""
    key = auth.get("Authorization")
    return json.dumps([key, peer if key is None else None])


def owner(body: dict[str, Any], client: str) -> str:
    """Whose conversations a request may continue: the same client, model and salt."""
    who = [client, body.get("model"), body.get("cache_salt")]
    return hashlib.sha256(json.dumps(who).encode()).hexdigest()


@dataclass(frozen=True)
class Kept:
    """A kept turn's ticket, whose it is, the decode that kept it, and its bytes."""

    ticket: dict[str, Any]
    client: str
    decode: str
    size: int


class Turns:
    """Kept turns by (owner, conversation), oldest first; ``enabled``: the engines keep
    turns (``--reuse-turns``), else nothing is asked or kept; ``down``: whether a decode
    is marked down."""

    def __init__(
        self,
        release: Callable[[dict[str, Any]], None],
        enabled: bool = True,
        down: Callable[[str], bool] = lambda _: False,
    ) -> None:
        self._kept: dict[tuple[str, str], Kept] = {}
        self._held: Counter[str] = Counter()  # bytes by client
        self._release, self.enabled, self._down = release, enabled, down

    def __len__(self) -> int:
        return len(self._kept)

    def asked(self, api: Api, body: dict[str, Any], decode_kv: str) -> str | None:
        """A fresh name to ask the decode to keep this turn as (``turn_id``), or None. Its
        ticket comes in a whole answer; a stream's (which carries none) from the decode's
        side channel ``decode_kv``, so without one a stream's turn is not asked."""
        kept = self.enabled and conversation(api, body) is not None
        return secrets.token_hex(16) if kept and (decode_kv or not body.get("stream")) else None

    def take(self, api: Api, body: dict[str, Any], client: str) -> dict[str, Any] | None:
        """The ticket of the longest kept conversation this request continues (taken)."""
        if not self.enabled or (text := conversation(api, body)) is None:
            return None
        now = time.time()
        for key in [k for k, t in self._kept.items() if t.ticket.get("expires_at", 0) <= now]:
            self._drop(key)
        who = owner(body, client)
        ours = [(w, t) for w, t in self._kept if w == who and text.startswith(t)]
        if not ours:
            return None
        kept = self._drop(max(ours, key=lambda k: len(k[1])))
        return None if self._down(kept.decode) else kept.ticket

    def keep(
        self, api: Api, body: dict[str, Any], client: str, ticket: Any, decode: str = ""
    ) -> None:
        """Keeps the ticket of the turn ``decode`` kept for this request, if any."""
        if not isinstance(ticket, dict) or not ticket.get("do_remote_prefill"):
            return
        if (text := conversation(api, body)) is None:
            self._release(ticket)  # kept for nothing we can continue: free it now
            return
        key = (owner(body, client), text)
        if key in self._kept:  # the same turn, again
            self._release(self._drop(key).ticket)
        size = len(text.encode(errors="surrogatepass")) + len(json.dumps(ticket))
        self._kept[key] = Kept(ticket, client, decode, size)
        self._held[client] += size
        while len(self._kept) > MAX_KEPT or self._held.total() > MAX_KEPT_BYTES:
            most = max(self._held, key=self._held.__getitem__)
            oldest = next(k for k, t in self._kept.items() if t.client == most)
            self._release(self._drop(oldest).ticket)

    def _drop(self, key: tuple[str, str]) -> Kept:
        kept = self._kept.pop(key)
        self._held[kept.client] -= kept.size
        if not self._held[kept.client]:
            del self._held[kept.client]
        return kept
