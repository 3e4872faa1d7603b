"""Multi-head latent attention (DeepSeek-V2/V3): an MLA layer's cache, as vLLM's CPU MLA
backends build and write it, read through the connector's `mla_latent` layout."""

from __future__ import annotations

import json

import pytest
import torch
from vllm.config import ModelConfig
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from testbed.handshake_ranks import rank_meta
from testbed.live_servers import random_model
from testbed.vllm_harness import make_kv_cache_config, make_vllm_config
from testbed.worker_processes import vllm_kv_caches
from vllm_qaic_connector.connector import QAICConnector
from vllm_qaic_connector.kv.kv_groups import attention_geometry
from vllm_qaic_connector.layout import get_layout
from vllm_qaic_connector.protocol.wire import incompatibility
from vllm_qaic_connector.worker.registration import RankIdentity, local_cache

LATENT, ROPE = 512, 64  # DeepSeek-V2/V3's, the size vLLM's CPU MLA decode kernel takes
LAYER = "model.layers.0.self_attn.attn"
ORDER = KVCacheLayout["LBNHC"]  # the order vLLM resolves on CPU (one head: any order)


def mla_config(block_size: int, dtype: torch.dtype, num_blocks: int = 8) -> KVCacheConfig:
    spec = MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=LATENT + ROPE, dtype=dtype
    )
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, 1, ORDER)
    where = KVCacheTensor(num_blocks * spec.page_size_bytes, [LAYER], layer_stride, block_stride)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[where],
        kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)],
    )


def vllm_cache(cfg: KVCacheConfig) -> torch.Tensor:
    """The layer's cache as vLLM builds it (`create_kv_cache_views`), random values."""
    gen = torch.Generator().manual_seed(0)
    [view] = vllm_kv_caches("mla_latent", attention_geometry(cfg), 1, cfg.num_blocks, gen)
    return view


# vLLM's two CPU MLA backends, each with its cache write and a block size it takes.
WRITERS = {"CPU_MLA": (CPUMLAImpl, 16), "AMX_MLA": (AMXMLAImpl, 32)}


def amx_mla_missing() -> str | None:
    """Why AMX_MLA's cache write cannot run here, or None."""
    if not hasattr(torch.ops._C, "concat_and_cache_mla_cpu"):
        return "this vLLM build has no AMX MLA cache-write kernel (concat_and_cache_mla_cpu)"
    if not torch.cpu._is_amx_tile_supported():
        return "this host has no AMX tiles"
    return None


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("CPU_MLA", torch.float32), ("CPU_MLA", torch.bfloat16), ("AMX_MLA", torch.bfloat16)],
    ids=str,
)  # AMX_MLA computes in bf16 only
def test_an_mla_cache_is_read_as_vllm_writes_it(backend, dtype):
    """vLLM's cache written by the backend's own ``do_kv_cache_update`` at scattered
    slots: each token's latent and RoPE key, read through the layout as one head's K then
    V, are exactly what vLLM was given."""
    if backend == "AMX_MLA" and (missing := amx_mla_missing()):
        pytest.skip(f"AMX_MLA's cache write not checked here: {missing}")
    impl, block = WRITERS[backend]
    cfg = mla_config(block, dtype)
    cache = vllm_cache(cfg)
    slots = torch.tensor([3, block + 1, block + 2, 5 * block - 1, 7 * block])
    kv_c, k_pe = torch.randn(len(slots), LATENT), torch.randn(len(slots), 1, ROPE)
    writer = impl.__new__(impl)  # the write needs none of the backend's weights
    writer.do_kv_cache_update(kv_c.to(dtype), k_pe.to(dtype), cache, slots, "auto", None)
    geometry = attention_geometry(cfg)
    identity = RankIdentity("e", 0, 1, 1, "m")
    layout = get_layout("mla_latent")
    got = local_cache({LAYER: cache}, identity, geometry, (), {}, layout=layout)
    assert (geometry.num_heads, 2 * geometry.head_size) == (1, LATENT + ROPE)
    [(k, v)] = got.layers
    for i, slot in enumerate(slots.tolist()):
        token = torch.cat([k[slot // block, 0, slot % block], v[slot // block, 0, slot % block]])
        want = torch.cat([kv_c[i], k_pe[i, 0]]).to(dtype)
        assert torch.equal(token, want), f"slot {slot}"


def test_an_mla_model_gets_the_latent_layout_and_one_replicated_head(tmp_path_factory, monkeypatch):
    """A DeepSeek-V2-style model: both halves start; the worker caches one latent head
    (the same on every TP rank) laid out as `mla_latent`, block size from vLLM's spec.
    (TP rank 0 stands in for vLLM's distributed group, which a test process lacks.)"""
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    model = random_model(tmp_path_factory, "deepseek_v2")
    cfg = json.loads((model / "config.json").read_text())
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]  # the size vLLM's kernel takes
    assert latent == LATENT + ROPE and latent in CPUMLABackend.get_supported_head_sizes()
    config = make_vllm_config("kv_producer")
    config.model_config = ModelConfig(model=str(model), max_model_len=1024, dtype="float32")
    assert config.model_config.use_mla
    QAICConnector(config, KVConnectorRole.SCHEDULER, make_kv_cache_config(16))
    worker = QAICConnector(config, KVConnectorRole.WORKER, mla_config(16, torch.float32)).worker
    assert worker is not None
    assert (worker.layout_name, worker.identity.total_kv_heads) == ("mla_latent", 1)
    assert (worker.geometry.num_heads, worker.geometry.head_size) == (1, (LATENT + ROPE) // 2)


def test_a_latent_cache_and_per_head_kv_do_not_pair(tmp_path_factory):
    """A QAIC program (or any engine) holding per-head K and V cannot take an MLA latent,
    whatever its shape happens to be: refused by name in the handshake."""
    latent = rank_meta(layout_kind="mla_latent", num_kv_heads=1, head_size=288)
    for other in ("qaic_slot", "LBHNC", "vllm_cpu_vec"):
        per_head = rank_meta(layout_kind=other, num_kv_heads=1, head_size=288)
        for a, b in ((latent, per_head), (per_head, latent)):
            problem = incompatibility(a, b)
            assert problem and "multi-head latent (MLA)" in problem, problem
    assert incompatibility(latent, latent) is None


def test_a_cache_mixing_latent_and_per_head_layers_names_the_layer_it_cannot_read():
    """A model whose layers mix MLA with per-head attention: the geometry is the latent's
    (the first attention group's), and the per-head layer's cache, of another size, stops
    start-up with its name and shape instead of being read as a latent."""
    mla = mla_config(16, torch.float32)
    per_head = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    other = "model.layers.1.self_attn.attn"
    cfg = KVCacheConfig(
        num_blocks=mla.num_blocks, kv_cache_tensors=mla.kv_cache_tensors,
        kv_cache_groups=[*mla.kv_cache_groups, KVCacheGroupSpec([other], per_head)],
    )  # fmt: skip
    caches = {LAYER: vllm_cache(mla), other: torch.zeros(mla.num_blocks, 2, 16, 128)}
    identity, layout = RankIdentity("e", 0, 1, 1, "m"), get_layout("mla_latent")
    with pytest.raises(ValueError, match=r"layers.1.self_attn.attn's KV cache has shape"):
        local_cache(caches, identity, attention_geometry(cfg), (), {}, layout=layout)
