"""The ticket: the ``kv_transfer_params`` a prefill returns for its staged KV
(`RemotePrefill`), which a router carries to a decode (or, for a kept turn, a decode's to the
conversation's next prefill), and its checks: its MAC, the prompt and blocks it names, what a
staged region's header binds (`ticket_binding`, see region_headers.py), its lease."""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from vllm_qaic_connector.protocol.keys import mac
from vllm_qaic_connector.protocol.names import HASH_RE, LAYOUT_KINDS, address_problem

_encoder = msgspec.msgpack.Encoder()


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """``kv_transfer_params`` of a decode request: where its prompt KV is staged, and the
    ticket that proves it still is (see region_headers.py)."""

    do_remote_prefill: bool
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    num_tokens: int
    staging_offset: int
    staged_layout: str
    staged_block_size: int
    incarnation: str  # the prefill engine's start; a restart invalidates every ticket
    generation: int  # repeated in the staged region's header while the region is ours
    prompt_hash: str  # of token ids [0, num_tokens): KV of another prompt is never used
    lease_s: float  # the prefill frees the region this long after the last renewal
    expires_at: float  # unix time the lease ends unless renewed
    group_starts: tuple[int, ...] = ()  # first token staged per KV cache group (): all 0
    adapter: str = ""  # the LoRA adapter that computed it (model_weights); "": the base model
    # Set: nothing was staged; read these blocks of the prefill's KV cache (its
    # `SharedCache`), which it holds until the region at ``staging_offset`` is released.
    block_ids: tuple[int, ...] = ()
    # The prefill server's cap on an answer's tokens (its generation config), for a router
    # that gives the client the prefill's token: None where there is none.
    max_tokens_cap: int | None = None
    # A kept turn's (`block_chain` of its tokens): a next turn whose prompt parts from the
    # turn's tokens (its answer's text tokenized otherwise) loads the whole blocks before.
    block_hashes: tuple[str, ...] = ()
    ticket_mac: str = ""  # with a key: the prefill's MAC over every field above


def ticket_mac(params: RemotePrefill, key: bytes) -> str:
    """The MAC a prefill puts on the params it returns: over every field but the MAC and
    the host, so an edited engine, start, request, offset, size, generation, prompt or
    expiry fails it. The host is the router's to name: production-stack's router overwrites
    it with the host it reaches the prefill by. Whatever answers there must prove the
    signed engine and start in a handshake only key holders can answer, so another host
    yields no KV. Times count in whole milliseconds (tickets carry them so): a router that
    re-serialises JSON numbers (vllm-router: floats come back 1 ULP off) leaves it whole."""
    unsigned = msgspec.structs.replace(
        params, do_remote_prefill=True, ticket_mac="", remote_host="",
        lease_s=round(params.lease_s * 1000), expires_at=round(params.expires_at * 1000),
    )  # fmt: skip
    return mac(key, b"ticket", _encoder.encode(unsigned)).hex()


def prompt_hash(token_ids: Sequence[int]) -> str:
    ids = struct.pack(f"<{len(token_ids)}q", *token_ids)  # as int64, little-endian
    return hashlib.blake2b(ids, digest_size=16).hexdigest()


def block_chain(token_ids: Sequence[int], block_size: int) -> tuple[str, ...]:
    """One hash per whole block, each over the one before and the block's token ids: two
    prompts' chains agree exactly as far as the whole blocks they begin with."""
    chain, digest = [], b""
    for end in range(block_size, len(token_ids) + 1, block_size):
        ids = struct.pack(f"<{block_size}q", *token_ids[end - block_size : end])
        digest = hashlib.blake2b(digest + ids, digest_size=16).digest()
        chain.append(digest.hex())
    return tuple(chain)


def shared_tokens(params: RemotePrefill, prompt: Sequence[int]) -> int:
    """How many of a kept turn's tokens ``prompt`` begins with: all of them, else its whole
    blocks as far as the prompt's agree (`block_chain`). Raises where none does."""
    if prompt_hash(prompt[: params.num_tokens]) == params.prompt_hash:
        return params.num_tokens
    ours = block_chain(prompt[: params.num_tokens], params.staged_block_size)
    # Two chains agree up to the last whole block both begin with, and never after it.
    same = sum(a == b for a, b in zip(ours, params.block_hashes, strict=False))
    if same == 0:
        raise ValueError("the prompt does not begin with the kept turn's first block")
    return same * params.staged_block_size


UNBOUND = bytes(16)  # the binding of a region sealed for no ticket (benchmarks, tests)


def ticket_binding(params: RemotePrefill) -> bytes:
    """What a staged region's header commits to besides its generation: the tokens, blocks
    and format its ticket names. A ticket edited to name other blocks (a kept turn's are
    the decode's live cache), more tokens or another prompt is refused by the header, with
    or without a key."""
    named = (
        params.num_tokens, params.prompt_hash, params.block_ids, params.block_hashes,
        params.adapter, params.staged_layout, params.staged_block_size, params.group_starts,
    )  # fmt: skip
    return hashlib.blake2b(_encoder.encode(named), digest_size=16).digest()


def ticket_problem(
    params: RemotePrefill,
    key: bytes | None,
    renewed_until: float = 0.0,
    prompt: Sequence[int] | None = None,
    adapter: str | None = None,
) -> str | None:
    """Why a decode must not use these params, or None: a missing or wrong MAC first (so an
    unsigned peer address is never contacted), then KV staged for another ``prompt`` or
    with other weights than the request's LoRA ``adapter`` ("": none), then an expired
    lease, unless the prefill confirmed renewals until ``renewed_until``."""
    if key is not None and not params.ticket_mac:
        return "ticket_mac is missing: this decode only accepts signed kv_transfer_params"
    if key is not None and not hmac.compare_digest(params.ticket_mac, ticket_mac(params, key)):
        return "ticket_mac does not match: the kv_transfer_params were forged or edited"
    if prompt is not None and params.num_tokens > len(prompt):
        return (
            f"malformed kv_transfer_params: num_tokens={params.num_tokens} exceeds the "
            f"prompt ({len(prompt)} tokens)"
        )
    if prompt is not None and prompt_hash(prompt[: params.num_tokens]) != params.prompt_hash:
        return "kv_transfer_params were staged for another prompt (prompt_hash differs)"
    if adapter is not None and adapter != params.adapter:
        return (
            f"the prefill computed this KV with {_weights(params.adapter)}, this request "
            f"runs {_weights(adapter)}: other weights, other KV"
        )
    if (late := time.time() - max(params.expires_at, renewed_until)) > 0:
        return f"the ticket expired {late:.1f}s ago (lease_s={params.lease_s})"
    return None


def _weights(adapter: str) -> str:
    return f"LoRA adapter {adapter}" if adapter else "the base model (no LoRA adapter)"


def parse_remote_prefill(params: dict[str, Any]) -> RemotePrefill:
    """Validate a decode request's ``kv_transfer_params``; the error names the field."""
    try:
        parsed = msgspec.convert(params, RemotePrefill, strict=False, from_attributes=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed kv_transfer_params: {exc}") from None
    if problem := field_problem(parsed):
        raise ValueError(f"malformed kv_transfer_params: {problem}")
    return parsed


def field_problem(p: RemotePrefill) -> str | None:
    """What is wrong with a ticket's fields, or None (each named)."""
    checks = [
        (p.num_tokens > 0, f"num_tokens must be > 0, got {p.num_tokens}"),
        (p.staging_offset >= 0, f"staging_offset must be >= 0, got {p.staging_offset}"),
        (p.staged_layout in LAYOUT_KINDS, f"staged_layout {p.staged_layout!r} is unknown"),
        (p.staged_block_size > 0, f"staged_block_size must be > 0, got {p.staged_block_size}"),
        (p.generation > 0, f"generation must be > 0, got {p.generation}"),
        (HASH_RE.fullmatch(p.prompt_hash), "prompt_hash must be 32 lowercase hex digits"),
        (p.lease_s > 0, f"lease_s must be > 0, got {p.lease_s}"),
        (p.expires_at > 0, f"expires_at must be > 0, got {p.expires_at}"),
        (
            len(p.group_starts) <= 64 and all(0 <= t < p.num_tokens for t in p.group_starts),
            f"group_starts must be at most 64 tokens in [0, num_tokens), got {p.group_starts}",
        ),
        (
            not p.block_ids
            or (
                len(p.block_ids) == -(-p.num_tokens // p.staged_block_size)
                and min(p.block_ids) >= 0
            ),
            "block_ids must be one id >= 0 per staged_block_size tokens of num_tokens",
        ),
        (
            len(p.block_hashes) <= p.num_tokens // max(p.staged_block_size, 1)
            and all(HASH_RE.fullmatch(h) for h in p.block_hashes),
            "block_hashes must be at most one 32-hex-digit hash per whole block of num_tokens",
        ),
    ]
    bad_address = address_problem(p.remote_host, p.remote_port, "remote_")
    return bad_address or next((why for ok, why in checks if not ok), None)
