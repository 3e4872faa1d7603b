"""Caches the connector cannot read stop start-up with an error that names them, rather
than a reshape error deep in vLLM's start-up (as a DeepSeek model's did)."""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from testbed.vllm_harness import make_kv_cache_config, make_vllm_config
from vllm_qaic_connector.connector import QAICConnector
from vllm_qaic_connector.layout import KVGeometry, get_layout
from vllm_qaic_connector.worker.registration import RankIdentity, local_cache


def test_pipeline_parallelism_is_refused_by_name():
    """Each stage holds part of the layers. Both halves refuse it where vLLM makes them
    (vLLM 0.32 offers a connector no earlier hook: they are made once the weights are
    loaded), naming the flag and what to use instead."""
    config = make_vllm_config("kv_consumer")
    config.parallel_config.pipeline_parallel_size = 2
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="pipeline parallelism .*--pipeline-parallel-size 2"):
            QAICConnector(config, role, make_kv_cache_config(16))


def test_a_cache_of_another_shape_names_its_layer_and_shape():
    """An MLA layer's cache as vLLM builds it ([blocks, 1, tokens, latent]) read as K and V
    of the geometry its spec states."""
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=320, dtype=torch.float32)
    layout, blocks, names = KVCacheLayout["LBHNC"], 8, ["model.layers.0.self_attn.attn"]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, 1, layout)
    raw = torch.empty(blocks * spec.page_size_bytes, dtype=torch.int8)
    where = KVCacheTensor(raw.numel(), names, layer_stride, block_stride)
    [view] = create_kv_cache_views(raw, spec, blocks, layout, where)
    geometry = KVGeometry(1, 320, 16, torch.float32)
    identity = RankIdentity("e", 0, 1, 1, "m")
    named = r"layers.0.self_attn.attn's KV cache has shape \(8, 1, 16, 320\)"
    with pytest.raises(ValueError, match=named):
        local_cache({names[0]: view}, identity, geometry, (), {}, layout=get_layout("LBHNC"))
