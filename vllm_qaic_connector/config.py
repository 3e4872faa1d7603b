"""Every knob of the connector, parsed and validated in one place."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

import msgspec

PREFIX_RE = re.compile(r"[A-Za-z0-9]+")  # ASCII only: it becomes part of buffer names


class ConnectorConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """``kv_connector_extra_config`` of ``--kv-transfer-config``. README lists every key."""

    transport: Literal["shm", "nixl"] = "shm"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: pick a free port; it travels in kv_transfer_params
    side_channel_advertise_host: str | None = None
    side_channel_key: str | None = None
    staging_bytes: int = 256 << 20
    staging_page_bytes: int = 256 << 10
    staging_wait_s: float = 5.0
    lease_s: float = 120.0
    handshake_timeout_s: float = 10.0
    load_timeout_s: float = 60.0
    verify_cpu_layout: bool = True
    kv_cache_prefix: str | None = None
    debug_corrupt_loaded_kv: bool = False

    def __post_init__(self) -> None:
        positive = {
            "staging_bytes": self.staging_bytes,
            "staging_page_bytes": self.staging_page_bytes,
            "lease_s": self.lease_s,
            "handshake_timeout_s": self.handshake_timeout_s,
            "load_timeout_s": self.load_timeout_s,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ValueError(f"{key} must be > 0, got {value}")
        if self.staging_wait_s < 0:
            raise ValueError("staging_wait_s must be >= 0")
        if self.staging_bytes < self.staging_page_bytes:
            raise ValueError(
                "staging_bytes must hold at least one page "
                f"({self.staging_bytes} < staging_page_bytes={self.staging_page_bytes})"
            )
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port out of range: {self.side_channel_port}")
        if self.kv_cache_prefix is not None and not PREFIX_RE.fullmatch(self.kv_cache_prefix):
            raise ValueError(f"kv_cache_prefix must be alphanumeric, got {self.kv_cache_prefix!r}")

    @property
    def advertise_host(self) -> str:
        return self.side_channel_advertise_host or self.side_channel_host

    @property
    def num_staging_pages(self) -> int:
        return self.staging_bytes // self.staging_page_bytes

    @property
    def shared_key(self) -> bytes | None:
        key = self.side_channel_key or os.environ.get("QAIC_KV_SIDE_CHANNEL_KEY")
        return key.encode() if key else None


def parse_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """Validate ``kv_connector_extra_config``; the error names the offending key."""
    try:
        return msgspec.convert(extra or {}, ConnectorConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid kv_connector_extra_config: {exc}") from None
