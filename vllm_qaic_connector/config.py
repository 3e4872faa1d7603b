"""Every knob of the connector, parsed and validated in one place."""

from __future__ import annotations

import ipaddress
from functools import cached_property
from typing import Any, Literal

import msgspec

from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.protocol.keys import KEY_ENV, load_key

logger = get_logger(__name__)
DEFAULT_STAGING_BYTES = 256 << 20  # the pool's floor
MAX_AUTO_STAGING = 4 << 30  # and the most it takes unasked: host memory on every staging rank
MAX_BLOCK_TOKENS = 1024  # the largest decode block a staged prompt's layers round up to
EVERY_ADDRESS = ("0.0.0.0", "::", "")  # binds that no peer can dial
_POSITIVE = ("staging_page_bytes", "lease_s", "handshake_timeout_s", "load_timeout_s")


class ConnectorConfig(
    msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, dict=True
):
    """``kv_connector_extra_config`` of ``--kv-transfer-config``; docs/configuration.md
    lists every key."""

    transport: Literal["shm", "nixl"] = "shm"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0  # 0: pick a free port; it travels in kv_transfer_params
    side_channel_advertise_host: str | None = None
    side_channel_key: str | None = None  # refused: see __post_init__
    side_channel_key_file: str | None = None
    allow_unauthenticated: bool = False
    staging_bytes: int | None = None  # None: sized_staging() sizes it for the model
    staging_page_bytes: int = 256 << 10
    staging_wait_s: float = 5.0
    # The most of the pool one decode's requests hold while other decodes are in play.
    decode_staging_share: float = 0.5
    lease_s: float = 120.0
    handshake_timeout_s: float = 10.0
    load_timeout_s: float = 60.0
    verify_cpu_layout: bool = True
    # Saves on a worker thread, off the engine's step; their blocks are held until done.
    async_saves: bool = True
    # A shm load (one KV cache group) runs in the step that schedules its request, before
    # the forward pass: its first token comes one or two engine steps sooner. Off by
    # default: a prefill that hangs mid-handshake would hold every running request's step.
    sync_loads: bool = False
    # Same layout, block size and TP: the decode copies the prompt's blocks out of the
    # prefill's KV cache, no staging copy. Over shm (one host, one user) on by default; over
    # NIXL it registers the whole KV cache with the agent, so any peer that completes a
    # handshake can READ any block: opt in where every peer is trusted (set a key).
    direct_reads: bool = True
    nixl_direct_reads: bool = False
    # A prefill's decodes ("host:port" side channels), for routers that name none: where
    # they all take one format, the prefill stages in it (or lets them read its cache).
    decode_peers: tuple[str, ...] = ()
    # Multi-turn reuse: a decode (kv_both) keeps a finished turn's blocks under a lease and
    # answers with a ticket for them; a prefill given that ticket loads the history's KV.
    reuse_turns: bool = False
    # Asked of vLLM for this engine's KV cache (it keeps its own where a backend cannot).
    kv_cache_layout: Literal["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"] | None = None
    debug_corrupt_loaded_kv: bool = False

    def __post_init__(self) -> None:
        if self.side_channel_key is not None:
            raise ValueError(
                "side_channel_key is not accepted: --kv-transfer-config shows in "
                "/proc/<pid>/cmdline and in vLLM's config log. Put the key in a file named by "
                f"side_channel_key_file (mode 0600) or in ${KEY_ENV}"
            )
        positive = {"staging_bytes": self.pool_bytes} | {k: getattr(self, k) for k in _POSITIVE}
        for key, value in positive.items():
            if value <= 0:
                raise ValueError(f"{key} must be > 0, got {value}")
        if self.staging_wait_s < 0:
            raise ValueError("staging_wait_s must be >= 0")
        if not 0 < self.decode_staging_share <= 1:
            raise ValueError(
                f"decode_staging_share must be in (0, 1], got {self.decode_staging_share}"
            )
        if self.pool_bytes < self.staging_page_bytes:
            raise ValueError(
                "staging_bytes must hold at least one page "
                f"({self.pool_bytes} < staging_page_bytes={self.staging_page_bytes})"
            )
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port out of range: {self.side_channel_port}")
        for peer in self.decode_peers:
            host, _, port = peer.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"decode_peers: {peer!r} is not host:port")

    @cached_property
    def advertise_host(self) -> str:
        """The host peers dial. Bound to every address (0.0.0.0, ::), that is this host's
        own address as vLLM finds it (``VLLM_HOST_IP``, else the default route's): a ticket
        naming 0.0.0.0 sends each decode to itself."""
        if self.side_channel_advertise_host:
            return self.side_channel_advertise_host
        if self.side_channel_host.strip("[]") not in EVERY_ADDRESS:
            return self.side_channel_host
        from vllm.utils.network_utils import get_ip  # only a wildcard bind asks vLLM

        found = get_ip()
        if found in EVERY_ADDRESS:
            raise ValueError(
                f"side_channel_host {self.side_channel_host!r} listens on every address, but "
                "this host has none to advertise (no default route): set "
                "side_channel_advertise_host, or VLLM_HOST_IP"
            )
        return found

    @property
    def decode_sides(self) -> list[tuple[str, int]]:
        return [(h, int(p)) for h, _, p in (peer.rpartition(":") for peer in self.decode_peers)]

    @property
    def pool_bytes(self) -> int:
        return DEFAULT_STAGING_BYTES if self.staging_bytes is None else self.staging_bytes

    @property
    def num_staging_pages(self) -> int:
        return self.pool_bytes // self.staging_page_bytes

    @cached_property
    def shared_key(self) -> bytes | None:
        """Read once: `parse_config` reads it first, so a bad key fails start-up by name."""
        return load_key(self.side_channel_key_file)


def sized_staging(cfg: ConnectorConfig, vllm_config: Any, kv_cache_config: Any) -> ConnectorConfig:
    """``staging_bytes`` where unset: room for one prompt that fills the context (vLLM's own
    per-request bound for each layer, plus a decode block's rounding), from 256 MiB to 4 GiB.
    Both halves size it alike. A fixed 256 MiB held 2,048 tokens of Llama-3-8B's KV, and
    longer prompts were never handed off; 4 GiB holds 32k. A pool that cuts prompts short of
    ``max_model_len`` is logged."""
    need = cfg.staging_page_bytes  # the region header's page
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec  # UniformTypeKVCacheSpecs: already every layer's
        layers = 1 if hasattr(spec, "kv_cache_specs") else len(group.layer_names)
        rounding = MAX_BLOCK_TOKENS * spec.page_size_bytes // spec.block_size
        need += layers * (spec.max_memory_usage_bytes(vllm_config) + rounding)
    if cfg.staging_bytes is None:
        pages = -(-need // cfg.staging_page_bytes)
        sized = min(max(DEFAULT_STAGING_BYTES, pages * cfg.staging_page_bytes), MAX_AUTO_STAGING)
        cfg = msgspec.structs.replace(cfg, staging_bytes=sized)
    if cfg.pool_bytes < need:
        context, page = vllm_config.model_config.max_model_len, cfg.staging_page_bytes
        per_token = (need - page) / (context + MAX_BLOCK_TOKENS)
        logger.warning(
            "QAICConnector: staging_bytes=%d holds prompts of at least %d tokens, not "
            "max_model_len=%d (%d bytes): longer ones are not handed off",
            cfg.pool_bytes, (cfg.pool_bytes - page) // per_token - MAX_BLOCK_TOKENS, context, need,
        )  # fmt: skip
    return cfg


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def parse_config(extra: dict[str, Any] | None) -> ConnectorConfig:
    """Validate ``kv_connector_extra_config``; the error names the offending key."""
    try:
        cfg = msgspec.convert(extra or {}, ConnectorConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid kv_connector_extra_config: {exc}") from None
    key = cfg.shared_key  # an unusable key fails at start-up, by name
    _ = cfg.advertise_host  # and a wildcard bind with no address to advertise
    if not (key or cfg.allow_unauthenticated or is_loopback(cfg.side_channel_host)):
        # Off loopback, anyone who reaches the port could read and free staged KV.
        raise ValueError(
            f"side_channel_host {cfg.side_channel_host!r} is not a loopback address and no "
            f"key is set: set side_channel_key_file or ${KEY_ENV}, or set "
            "allow_unauthenticated: true on an isolated network"
        )
    return cfg
