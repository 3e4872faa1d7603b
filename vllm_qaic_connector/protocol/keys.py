"""The side channel's shared key: where it comes from, what makes it usable, and the MACs
it makes. One key serves several purposes; each MAC covers a purpose label first, so a MAC
made for one purpose (say, a ticket) is never valid for another (a side-channel frame)."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

KEY_ENV = "QAIC_KV_SIDE_CHANNEL_KEY"
MIN_KEY_BYTES = 16
MAC_BYTES = 32


def mac(key: bytes | None, purpose: bytes, payload: bytes) -> bytes:
    """HMAC-SHA256 of ``purpose`` and ``payload``; zeros without a key."""
    if not key:
        return b"\0" * MAC_BYTES
    return hmac.new(key, purpose + b"\0" + payload, hashlib.sha256).digest()


def load_key(key_file: str | None) -> bytes | None:
    """The shared key, from ``key_file`` or the environment; never logged. Raises ValueError
    naming the problem (never the key)."""
    if key_file is None:
        key, where = os.environ.get(KEY_ENV, "").encode(), f"${KEY_ENV}"
    else:
        try:
            fd = os.open(key_file, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ValueError(f"side_channel_key_file {key_file!r}: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            if (mode := os.fstat(f.fileno()).st_mode) & (stat.S_IRWXG | stat.S_IRWXO):
                raise ValueError(
                    f"side_channel_key_file {key_file!r} is open to other users "
                    f"(mode {stat.S_IMODE(mode):04o}); chmod 600 it"
                )
            key, where = f.read().strip(), f"side_channel_key_file {key_file!r}"
        if not key:
            raise ValueError(f"{where} is empty")
    if not key:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the key in {where} is shorter than {MIN_KEY_BYTES} bytes")
    return key
