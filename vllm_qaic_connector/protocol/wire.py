"""Everything that crosses a process boundary: side-channel messages, transfer params and
NIXL acknowledgements, with the MACs that authenticate them when a key is set.

One key serves three purposes; each MAC covers a purpose label first, so a MAC made for one
purpose (say, a ticket) is never valid for another (a side-channel frame).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import struct
import time
from collections.abc import Sequence
from typing import Any

import msgspec

# 7: a region's header binds its ticket's tokens, blocks and format (`ticket_binding`);
# 6: vLLM CPU's packings by name, layer names; 5: vLLM 0.32's layouts.
PROTOCOL_VERSION = 7
HOST_RE = re.compile(r"[A-Za-z0-9._:\-\[\]]{1,255}")  # a DNS name, IPv4 or IPv6 literal
HASH_RE = re.compile(r"[0-9a-f]{32}")
ENDPOINT_ADDRESS = re.compile(r"([^@]+)(?:@0x[0-9a-f]+)?")


# The physical KV layouts peers name (layout.py has one class per name): vLLM's six
# `KVCacheLayout` orders, vLLM CPU's packings (one per family of attention ISAs) and the
# QAIC slots. Here, not there: the proxy reads tickets and must not import torch.
LAYOUT_KINDS = (
    "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC",
    "vllm_cpu_vec", "vllm_cpu_amx", "vllm_cpu_neon_bf16", "qaic_slot", "mla_latent",
)  # fmt: skip
# Older names, read as vLLM reads its legacy VLLM_KV_CACHE_LAYOUT values.
LAYOUT_ALIASES = {"cuda_nhd": "LBNHC", "cuda_hnd": "LBHNC", "NHD": "LBNHC", "HND": "LBHNC"}


# A KV cache's element type, by torch's name: a handshake states one of these.
KV_DTYPES = frozenset({
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "uint8",
})  # fmt: skip


def staging_name(engine_id: str, tp_rank: int, incarnation: str) -> str:
    """The shm segment (or NIXL agent) of one rank. The random incarnation makes it
    unguessable; peers check a handshake's endpoint against it (`peers.check_ranks`)."""
    return f"qaic_kv_{engine_id}_r{tp_rank}_{incarnation}"


class TransportEndpoint(msgspec.Struct, frozen=True):
    """Where a rank's staging region can be reached: a shm segment name or NIXL agent metadata.
    ``address`` is ``<name>`` or ``<name>@0x<base>`` (a NIXL agent and its staging's base)."""

    kind: str
    address: str
    size: int
    agent_metadata: bytes = b""
    device: int = -1  # where the region lies: -1 host memory, else a CUDA device's index

    @property
    def owner(self) -> str | None:
        """The segment or agent the address names; None where it is not an address."""
        found = ENDPOINT_ADDRESS.fullmatch(self.address)
        return found[1] if found else None


class SharedCache(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill rank's KV cache, readable by its peers: moved into shared memory (shm) or
    registered with its NIXL agent at start-up. A decode rank with the same layout, block
    size and TP copies a prompt's blocks straight out of it (`worker.direct_reads`): no staging."""

    size: int
    shape: tuple[int, ...]  # every layer's physical shape
    strides: tuple[int, ...]  # in elements
    layer_offsets: tuple[int, ...]  # each layer's first element
    path: str = ""  # shm: /proc/<pid>/fd/<fd> of the prefill worker (the object is unlinked)
    inode: int = 0  # shm: tells that object from whatever a reused pid or fd may show later
    host: str = ""  # shm: boot id, PID namespace and uid: who can open ``path``
    address: int = 0  # nixl: the cache's base address in the prefill, registered
    device: int = -1  # nixl: the CUDA device holding it (-1: host memory)

    @property
    def mapped(self) -> bool:
        """A mapped cache (a path) is read through views that convert layouts and block
        sizes; registered memory (an address) is read as whole blocks of one format."""
        return bool(self.path)


class RankMetadata(msgspec.Struct, frozen=True):
    """What one worker rank tells its peers. Block size, layout and TP are negotiated;
    the compatibility hash covers only what must be equal."""

    engine_id: str
    tp_rank: int
    tp_size: int
    layout_kind: str
    block_size: int
    num_blocks: int
    num_kv_heads: int  # total across ranks
    head_size: int
    dtype: str
    num_layers: int
    model: str  # its name, for messages: the weights fingerprint tells models apart
    compat_hash: str
    endpoint: TransportEndpoint
    incarnation: str = ""  # fresh at every engine start; tickets name it
    cache: SharedCache | None = None  # where decodes may read our KV cache directly
    host: str = ""  # set where this rank reads peers' caches directly: `host_identity()`
    weights: str = ""  # the checkpoint's fingerprint; "": unknown, the names must match
    # Every KV layer's name in vLLM (target's, drafter's), in the order staged KV holds
    # them; empty where the peer does not say (a QAIC decode: its buffers are numbered).
    layers: tuple[str, ...] = ()
    drafter: str = ""  # the speculative drafter's method and weights fingerprint ("": none)


COMPAT_FIELDS = ("num_layers", "num_kv_heads", "head_size")
# What a QAIC decode converts into its programs' KV dtype inside its slot copy: plain floats
# (float16 holds every bf16 value of its normal range exactly). fp8 and int8 KV hold scaled
# or compressed values: converting them needs their scales.
CONVERTIBLE_DTYPES = frozenset({"bfloat16", "float16", "float32"})
# A speculative drafter (EAGLE, MTP) keeps KV layers of its own: an engine running one differs
# in layers from a peer that does not, though both serve one model (vLLM's NixlConnector
# refuses such peers too).
DRAFTER_HINT = "; a speculative drafter's KV layers count: run one --speculative-config on both"
HINTS = {
    "num_layers": DRAFTER_HINT,
    "dtype": "; only a QAIC decode converts, between " + ", ".join(sorted(CONVERTIBLE_DTYPES)),
}


def compat_hash(
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    windows: tuple[int, ...] = (),
    states: tuple[str, ...] = (),
) -> str:
    """``windows``: each layer's sliding window, for hybrid models (empty: all full);
    ``states``: each Mamba layer's state shapes and TP split (``RecurrentState.signature``)."""
    text = f"{num_layers}|{num_kv_heads}|{head_size}"
    if any(windows):
        text += f"|{','.join(map(str, windows))}"
    if states:
        text += f"|state:{';'.join(states)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def incompatibility(mine: RankMetadata, theirs: RankMetadata) -> str | None:
    """Names the first field that makes two engines unable to share KV, or None."""
    # A side without a fingerprint: the model's name is all there is.
    fingerprints = mine.weights and theirs.weights
    if (mine.weights != theirs.weights) if fingerprints else (mine.model != theirs.model):
        return (
            f"peer {theirs.engine_id!r} computes KV with other weights: ours={mine.model!r} "
            f"({mine.weights or 'no fingerprint'}) theirs={theirs.model!r} "
            f"({theirs.weights or 'no fingerprint'}); the same checkpoint, quantization "
            "and RoPE settings are needed on both sides"
        )
    if (mine.layout_kind == "mla_latent") != (theirs.layout_kind == "mla_latent"):
        return (
            f"peer {theirs.engine_id!r} caches {theirs.layout_kind} KV, ours {mine.layout_kind}: "
            "a multi-head latent (MLA) has no per-head K and V to convert from or to"
        )
    qaic = "qaic_slot" in (mine.layout_kind, theirs.layout_kind)
    converts = qaic and {mine.dtype, theirs.dtype} <= CONVERTIBLE_DTYPES
    for field in COMPAT_FIELDS + (() if converts else ("dtype",)):
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            hint = HINTS.get(field, "")
            return f"peer {theirs.engine_id!r} differs in {field}: ours={a!r} theirs={b!r}{hint}"
    if mine.layers and theirs.layers and mine.layers != theirs.layers:
        pairs = enumerate(zip(mine.layers, theirs.layers, strict=True))
        i = next(i for i, (a, b) in pairs if a != b)
        return (
            f"peer {theirs.engine_id!r} holds other KV layers: its layer {i} is "
            f"{theirs.layers[i]!r}, ours {mine.layers[i]!r}{DRAFTER_HINT}"
        )
    if mine.drafter != theirs.drafter:
        return (
            f"peer {theirs.engine_id!r} runs another speculative drafter: ours="
            f"{mine.drafter or 'none'} theirs={theirs.drafter or 'none'}{DRAFTER_HINT}"
        )
    if mine.compat_hash != theirs.compat_hash:
        return (
            f"peer {theirs.engine_id!r} has a different compatibility hash: its sliding "
            "windows or Mamba state shapes differ (a state whose TP split is unknown, i.e. "
            "not Mamba2's, needs the same TP size on both sides)"
        )
    return None


def direct_problem(prefill: RankMetadata, decode: RankMetadata, prefill_tp: int) -> str | None:
    """Why ``decode`` cannot read ``prefill``'s cache directly, or None."""
    if prefill.cache is None:
        return "the prefill does not share its KV cache"
    if not decode.host:
        return "the decode does not read caches directly"
    if prefill_tp != decode.tp_size:
        return "TP sizes differ"
    if prefill.endpoint.kind != decode.endpoint.kind:
        return "transports differ"
    formats = [(r.layout_kind, r.block_size) for r in (prefill, decode)]
    if formats[0] != formats[1] and not prefill.cache.mapped:
        return "layouts or block sizes differ (reads of registered memory move whole blocks)"
    if prefill.cache.path and prefill.cache.host != decode.host:
        return "not the same host, PID namespace and user"
    return None


# --- kv_transfer_params --------------------------------------------------------------------


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


# --- side-channel messages -------------------------------------------------------------


class HandshakeRequest(msgspec.Struct, tag="handshake", frozen=True):
    version: int
    engine_id: str


class HandshakeReply(msgspec.Struct, tag="handshake_reply", frozen=True):
    version: int
    ranks: list[RankMetadata]


class ReleaseRequest(msgspec.Struct, tag="release", frozen=True):
    """Decode rank ``reader_rank`` of ``reader_tp`` is done with the prefill ranks
    ``source_ranks`` (None: every rank it reads from). The staging is freed once every
    (reader rank, source rank) pair that the two TP sizes need said so."""

    request_ids: list[str]
    reader_rank: int = 0
    reader_tp: int = 1
    source_ranks: list[int] | None = None


class RenewRequest(msgspec.Struct, tag="renew", frozen=True):
    """A decode still wants these requests' KV (queued, or waiting for blocks)."""

    request_ids: list[str]


def ack_message(
    request_id: str, reader_rank: int, reader_tp: int, source_rank: int, key: bytes | None
) -> bytes:
    """The notification a reader attaches to its read of one source rank (it frees staging,
    so with a key it carries a MAC)."""
    payload = _encoder.encode(ReleaseRequest([request_id], reader_rank, reader_tp, [source_rank]))
    return _mac(key, b"ack", payload) + payload


def parse_ack(message: bytes, key: bytes | None) -> ReleaseRequest | None:
    """None for anything but a well-formed acknowledgement (authenticated, with a key)."""
    mac, payload = message[:_MAC_LEN], message[_MAC_LEN:]
    if key and not hmac.compare_digest(mac, _mac(key, b"ack", payload)):
        return None
    try:
        return msgspec.msgpack.decode(payload, type=ReleaseRequest)
    except msgspec.DecodeError:
        return None


class Ok(msgspec.Struct, tag="ok", frozen=True):
    """A request done, with nothing to answer (a release's reply)."""


class ErrorReply(msgspec.Struct, tag="error", frozen=True):
    message: str


class Renewed(msgspec.Struct, tag="renewed", frozen=True):
    """The requests of a RenewRequest whose leases were renewed (the rest are gone)."""

    request_ids: list[str]


class TurnRequest(msgspec.Struct, tag="turn", frozen=True):
    """A router asks a decode for the ticket of the turn it kept as ``turn_id`` (the
    request's ``keep_turn``): a streamed answer carries no ``kv_transfer_params``."""

    turn_id: str


class TurnReply(msgspec.Struct, tag="turn_reply", frozen=True):
    ticket: RemotePrefill


Message = (
    HandshakeRequest | HandshakeReply | ReleaseRequest | RenewRequest | Renewed | TurnRequest
    | TurnReply | Ok | ErrorReply
)  # fmt: skip


def handshake_reply(request: HandshakeRequest, ranks: list[RankMetadata]) -> Message:
    """An engine's answer to a handshake: its ranks, sorted, once every rank registered."""
    if request.version != PROTOCOL_VERSION:
        return ErrorReply(f"protocol version {request.version}, we speak {PROTOCOL_VERSION}")
    if not ranks:
        return ErrorReply("engine not ready: workers have not registered KV caches")
    return HandshakeReply(PROTOCOL_VERSION, sorted(ranks, key=lambda r: r.tp_rank))


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """A side-channel frame's content. The nonce and the send time, inside the MAC, make a
    captured frame useless later; a reply names the nonce of the request it answers."""

    nonce: bytes
    sent_at: float  # unix time
    in_reply_to: bytes
    message: Message


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)
_MAC_LEN = 32
NONCE_BYTES = 16


def _mac(key: bytes | None, purpose: bytes, payload: bytes) -> bytes:
    if not key:
        return b"\0" * _MAC_LEN
    return hmac.new(key, purpose + b"\0" + payload, hashlib.sha256).digest()


def encode_message(
    msg: Message, key: bytes | None, *, nonce: bytes | None = None, in_reply_to: bytes = b""
) -> bytes:
    envelope = Envelope(nonce or secrets.token_bytes(NONCE_BYTES), time.time(), in_reply_to, msg)
    payload = _encoder.encode(envelope)
    return _mac(key, b"side-channel", payload) + payload


def open_message(frame: bytes, key: bytes | None) -> Envelope:
    """Raises ValueError on a bad MAC (when a key is set) or a malformed frame. Freshness
    and replays are the receiver's to check (see side_channel.ReplayGuard)."""
    mac, payload = frame[:_MAC_LEN], frame[_MAC_LEN:]
    if key and not hmac.compare_digest(mac, _mac(key, b"side-channel", payload)):
        raise ValueError("side-channel message failed authentication")
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed side-channel message: {exc}") from None


# --- tickets ---------------------------------------------------------------------------


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
    return _mac(key, b"ticket", _encoder.encode(unsigned)).hex()


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
    if problem := _remote_prefill_problem(parsed):
        raise ValueError(f"malformed kv_transfer_params: {problem}")
    return parsed


def _remote_prefill_problem(p: RemotePrefill) -> str | None:
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


def address_problem(host: object, port: object, field_prefix: str = "") -> str | None:
    """Names what is wrong with a peer address (``field_prefix`` + port/host), or None."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return f"{field_prefix}port must be in 1..65535, got {port!r}"
    if not isinstance(host, str) or not HOST_RE.fullmatch(host):
        return f"{field_prefix}host {host!r} is not a host name"
    return None
