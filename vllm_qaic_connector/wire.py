"""Everything that crosses a process boundary: side-channel messages and transfer params."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgspec

PROTOCOL_VERSION = 1


class TransportEndpoint(msgspec.Struct, frozen=True):
    """Where a rank's staging region can be reached: a shm segment name or NIXL agent metadata."""

    kind: str
    address: str
    size: int
    agent_metadata: bytes = b""


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
    model: str
    compat_hash: str
    endpoint: TransportEndpoint


COMPAT_FIELDS = ("model", "dtype", "num_layers", "num_kv_heads", "head_size")


def compat_hash(model: str, dtype: str, num_layers: int, num_kv_heads: int, head_size: int) -> str:
    text = f"{model}|{dtype}|{num_layers}|{num_kv_heads}|{head_size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def incompatibility(mine: RankMetadata, theirs: RankMetadata) -> str | None:
    """Names the first field that makes two engines unable to share KV, or None."""
    for field in COMPAT_FIELDS:
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            return f"peer {theirs.engine_id!r} differs in {field}: ours={a!r} theirs={b!r}"
    if mine.compat_hash != theirs.compat_hash:
        return f"peer {theirs.engine_id!r} has a different compatibility hash"
    return None


# --- side-channel messages -------------------------------------------------------------


class HandshakeRequest(msgspec.Struct, tag="handshake", frozen=True):
    version: int
    engine_id: str


class HandshakeReply(msgspec.Struct, tag="handshake_reply", frozen=True):
    version: int
    ranks: list[RankMetadata]


class ReleaseRequest(msgspec.Struct, tag="release", frozen=True):
    """Decode rank ``reader_rank`` of ``reader_tp`` has the KV (or gave up). The staging is
    freed once every reader rank said so: with TP, ranks read at their own pace."""

    request_ids: list[str]
    reader_rank: int = 0
    reader_tp: int = 1


def ack_message(request_id: str, reader_rank: int, reader_tp: int) -> bytes:
    """The notification a reader attaches to its read: a one-request ReleaseRequest."""
    return _encoder.encode(ReleaseRequest([request_id], reader_rank, reader_tp))


def parse_ack(message: bytes) -> ReleaseRequest | None:
    try:
        return msgspec.msgpack.decode(message, type=ReleaseRequest)
    except msgspec.DecodeError:
        return None


class Ok(msgspec.Struct, tag="ok", frozen=True):
    pass


class ErrorReply(msgspec.Struct, tag="error", frozen=True):
    message: str


Message = HandshakeRequest | HandshakeReply | ReleaseRequest | Ok | ErrorReply
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_MAC_LEN = 32


def encode_message(msg: Message, key: bytes | None) -> bytes:
    payload = _encoder.encode(msg)
    mac = hmac.new(key, payload, hashlib.sha256).digest() if key else b"\0" * _MAC_LEN
    return mac + payload


def decode_message(frame: bytes, key: bytes | None) -> Message:
    """Raises ValueError on a bad MAC (when a key is set) or a malformed message."""
    mac, payload = frame[:_MAC_LEN], frame[_MAC_LEN:]
    if key and not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()):
        raise ValueError("side-channel message failed authentication")
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed side-channel message: {exc}") from None


# --- kv_transfer_params --------------------------------------------------------------------


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """``kv_transfer_params`` of a decode request: where its prompt KV is staged."""

    do_remote_prefill: bool
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    num_tokens: int
    staging_offset: int
    staged_layout: str
    staged_block_size: int


class StagedPrefill(RemotePrefill, frozen=True, kw_only=True):
    """What the prefill returns; the proxy forwards it to the decode unchanged."""

    do_remote_decode: bool = False


def parse_remote_prefill(params: dict[str, Any]) -> RemotePrefill:
    """Validate a decode request's ``kv_transfer_params``; the error names the field."""
    try:
        parsed = msgspec.convert(params, RemotePrefill, strict=False, from_attributes=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed kv_transfer_params: {exc}") from None
    if parsed.num_tokens <= 0 or parsed.staging_offset < 0:
        raise ValueError(
            "malformed kv_transfer_params: num_tokens must be > 0 and staging_offset >= 0"
        )
    return parsed
