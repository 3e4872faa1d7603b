"""What engines say to each other: the handshake (each rank's `RankMetadata`), side-channel
messages and NIXL acknowledgements, with the MACs that authenticate them when a key is set
(`keys.mac`). The ticket a router carries is `ticket`'s; what a router asks of an engine is
`routed_params`'s."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

import msgspec

from vllm_qaic_connector.protocol.keys import MAC_BYTES, mac
from vllm_qaic_connector.protocol.ticket import RemotePrefill

# 7: a region's header binds its ticket's tokens, blocks and format (`ticket_binding`);
# 6: vLLM CPU's packings by name, layer names; 5: vLLM 0.32's layouts.
PROTOCOL_VERSION = 7
ENDPOINT_ADDRESS = re.compile(r"([^@]+)(?:@0x[0-9a-f]+)?")


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
    return mac(key, b"ack", payload) + payload


def parse_ack(message: bytes, key: bytes | None) -> ReleaseRequest | None:
    """None for anything but a well-formed acknowledgement (authenticated, with a key)."""
    tag, payload = message[:MAC_BYTES], message[MAC_BYTES:]
    if key and not hmac.compare_digest(tag, mac(key, b"ack", payload)):
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
NONCE_BYTES = 16


def encode_message(
    msg: Message, key: bytes | None, *, nonce: bytes | None = None, in_reply_to: bytes = b""
) -> bytes:
    envelope = Envelope(nonce or secrets.token_bytes(NONCE_BYTES), time.time(), in_reply_to, msg)
    payload = _encoder.encode(envelope)
    return mac(key, b"side-channel", payload) + payload


def open_message(frame: bytes, key: bytes | None) -> Envelope:
    """Raises ValueError on a bad MAC (when a key is set) or a malformed frame. Freshness
    and replays are the receiver's to check (see side_channel.ReplayGuard)."""
    tag, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
    if key and not hmac.compare_digest(tag, mac(key, b"side-channel", payload)):
        raise ValueError("side-channel message failed authentication")
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed side-channel message: {exc}") from None
