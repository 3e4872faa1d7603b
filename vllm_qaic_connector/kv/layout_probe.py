"""Which physical layout a registered KV cache has: vLLM's resolved `KVCacheLayout` on a
GPU; on vLLM's CPU backend the packing of the attention ISA vLLM picked on this host,
checked against the installed vLLM's own cache-write op before it is trusted.

Hosts differ (AVX2, AVX-512, AMX, ARM, ...), so the packing is found here, never assumed.
"""

from __future__ import annotations

import torch

from vllm_qaic_connector.kv.token_copies import gather_tokens
from vllm_qaic_connector.layout import KVGeometry, KVLayout, get_layout
from vllm_qaic_connector.logs import get_logger

logger = get_logger(__name__)

# The packings each ISA of vLLM 0.32 CPU may write, the likeliest first (`neon` writes
# BFMMLA's tiles for bf16 where vLLM was built with ARM bf16, else `vec`'s; float32 and
# float16 always `vec`'s: csrc/cpu/cpu_attn_neon.hpp).
ISA_PACKINGS: dict[str, tuple[str, ...]] = {
    "amx": ("vllm_cpu_amx",),
    "neon": ("vllm_cpu_neon_bf16", "vllm_cpu_vec"),
} | {isa: ("vllm_cpu_vec",) for isa in ("vec", "vec16", "vsx", "vxe", "rvv")}


def attention_isa(geometry: KVGeometry) -> str:
    """The ISA vLLM's CPU attention picks for this cache on this host (its own function)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(geometry.dtype, geometry.block_size, geometry.head_size))


def matches_vllm_op(kind: str, isa: str, geometry: KVGeometry) -> bool:
    """Whether vLLM's cache-write op with ``isa`` packs tokens the way layout ``kind`` reads
    them: random K and V over a block edge, into blocks out of order."""
    from vllm import _custom_ops as ops

    bs, head_size, dtype = geometry.block_size, geometry.head_size, geometry.dtype
    geo = KVGeometry(num_heads=2, head_size=head_size, block_size=bs, dtype=dtype)
    layout = get_layout(kind)
    num_tokens = bs + 3  # crosses a block edge
    layer = layout.allocate(3, geo)
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(num_tokens, 2, head_size, generator=gen).to(dtype) for _ in "kv")
    blocks = [2, 0]  # out of order on purpose
    t = torch.arange(num_tokens)  # int64, as vLLM's slot mapping
    slots = torch.tensor(blocks)[t // bs] * bs + t % bs
    k_cache, v_cache = layer.view(3, 2, 2 * bs, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)
    got_k, got_v = gather_tokens(layout.kv_views(layer, geo), blocks, num_tokens)
    return torch.equal(got_k, key.transpose(0, 1)) and torch.equal(got_v, value.transpose(0, 1))


def cpu_layout(geometry: KVGeometry, verify: bool = True) -> KVLayout:
    """The packing of this host's vLLM CPU KV cache, proven with vLLM's own op (unless
    ``verify`` is off: then the ISA's likeliest packing)."""
    if geometry.dtype.itemsize == 1:
        raise RuntimeError(
            "QAICConnector does not move vLLM CPU's fp8 KV cache (--kv-cache-dtype "
            f"{geometry.dtype}): its packing is not verified; serve with the default "
            "kv-cache-dtype"
        )
    isa = attention_isa(geometry)
    kinds = ISA_PACKINGS.get(isa, ())
    if geometry.dtype != torch.bfloat16:  # BFMMLA's tiles hold bf16 alone
        kinds = tuple(k for k in kinds if k != "vllm_cpu_neon_bf16")
    for kind in kinds if verify else kinds[:1]:
        if not verify or matches_vllm_op(kind, isa, geometry):
            how = "checked with vLLM's cache-write op" if verify else "unchecked"
            logger.info("QAICConnector: vLLM CPU attention ISA %s packs KV as %s (%s)",
                        isa, kind, how)  # fmt: skip
            return get_layout(kind)
    raise RuntimeError(
        f"vLLM's CPU attention ISA {isa!r} packs this KV cache (block {geometry.block_size}, "
        f"head {geometry.head_size}, {geometry.dtype}) in a way none of this connector's "
        f"packings ({', '.join(kinds) or 'none known'}) match; refusing to transfer KV"
    )


def resolved_layout(name: str | None, geometry: KVGeometry, verify: bool = True) -> KVLayout:
    """The layout vLLM resolved for this engine's KV cache (``KVCacheConfig.kv_cache_layout``),
    never a guess from shapes. vLLM's CPU backend records LBHNC but packs each block its own
    way per host (`cpu_layout`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and name != "mla_latent":  # MLA: one layout everywhere
        return cpu_layout(geometry, verify)
    if not name:  # an older vLLM: its [2, blocks, ...] caches are not these layouts
        raise RuntimeError("QAICConnector needs vLLM >= 0.32 (KVCacheConfig.kv_cache_layout)")
    return get_layout(name)
