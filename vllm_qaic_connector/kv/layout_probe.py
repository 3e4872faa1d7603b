"""Which physical layout a registered KV cache has, and a check of `VllmCpuLayout` against
the installed vLLM's own cache-write op.

The CPU backend's packing depends on the ISA kernel vLLM picks, so we refuse to move KV
in a layout we could not confirm on this machine.
"""

from __future__ import annotations

import torch

from vllm_qaic_connector.kv.layout import KVGeometry, KVLayout, gather_tokens, get_layout


def write_with_vllm_op(
    layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[tokens, heads, head_dim]`` at ``slots`` the way vLLM's CPU
    attention backend does."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nb, heads, bs, two_d = layer.shape
    key_cache, value_cache = layer.view(nb, heads, 2 * bs, two_d // 2).chunk(2, dim=2)
    isa = _get_attn_isa(layer.dtype, bs, two_d // 2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


def verify_vllm_cpu_layout(block_size: int, head_size: int, dtype: torch.dtype) -> None:
    """Raises RuntimeError if vLLM's CPU cache op disagrees with `VllmCpuLayout`."""
    geo = KVGeometry(num_heads=2, head_size=head_size, block_size=block_size, dtype=dtype)
    layout = get_layout("vllm_cpu")
    num_tokens = block_size + 3  # crosses a block edge
    layer = layout.allocate(3, geo)
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(num_tokens, 2, head_size, generator=gen).to(dtype) for _ in "kv")
    blocks = [2, 0]  # out of order on purpose
    t = torch.arange(num_tokens)  # int64, as vLLM's slot mapping
    slots = torch.tensor(blocks)[t // block_size] * block_size + t % block_size
    write_with_vllm_op(layer, key, value, slots)
    got_k, got_v = gather_tokens(layout.kv_views(layer, geo), blocks, num_tokens)
    if not (torch.equal(got_k, key.transpose(0, 1)) and torch.equal(got_v, value.transpose(0, 1))):
        raise RuntimeError(
            f"vLLM's CPU KV cache layout (block {block_size}, head {head_size}, {dtype}) does "
            "not match the layout this connector knows; refusing to transfer KV. Set "
            "verify_cpu_layout=false only if you have checked the layout yourself."
        )


def resolved_layout(name: str | None) -> KVLayout:
    """The layout vLLM resolved for this engine's KV cache (``KVCacheConfig.kv_cache_layout``),
    never a guess from shapes. vLLM's CPU backend records LBHNC but packs each block its own
    way (K transposed), which `verify_vllm_cpu_layout` checks."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return get_layout("vllm_cpu")
    if not name:  # an older vLLM: its [2, blocks, ...] caches are not these layouts
        raise RuntimeError("QAICConnector needs vLLM >= 0.32 (KVCacheConfig.kv_cache_layout)")
    return get_layout(name)
