"""The names peers exchange and what each may be: physical KV layouts, KV dtypes, host
names and the hashes tickets carry. Standard library only: the proxy reads tickets and must
not import torch."""

from __future__ import annotations

import re

HOST_RE = re.compile(r"[A-Za-z0-9._:\-\[\]]{1,255}")  # a DNS name, IPv4 or IPv6 literal
HASH_RE = re.compile(r"[0-9a-f]{32}")


# The physical KV layouts peers name (layout.py has one class per name): vLLM's six
# `KVCacheLayout` orders, vLLM CPU's packings (one per family of attention ISAs) and the
# QAIC slots.
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


def address_problem(host: object, port: object, field_prefix: str = "") -> str | None:
    """Names what is wrong with a peer address (``field_prefix`` + port/host), or None."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return f"{field_prefix}port must be in 1..65535, got {port!r}"
    if not isinstance(host, str) or not HOST_RE.fullmatch(host):
        return f"{field_prefix}host {host!r} is not a host name"
    return None
