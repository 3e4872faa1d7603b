"""The staging pool's default size: one prompt that fills the context, for the model served
(vLLM's own KV cache specs), so a real model's long prompts are handed off."""

from __future__ import annotations

import logging

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from testbed.vllm_harness import make_kv_cache_config, make_vllm_config
from vllm_qaic_connector.config import (
    DEFAULT_STAGING_BYTES,
    MAX_AUTO_STAGING,
    MAX_BLOCK_TOKENS,
    parse_config,
    sized_staging,
)
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.layout import KVGeometry
from vllm_qaic_connector.region_headers import HEADER_BYTES
from vllm_qaic_connector.scheduler.staging import StagingPool

LAYERS, HEADS, HEAD, BF16 = 32, 8, 128, torch.bfloat16  # Llama-3-8B's KV: 128 KiB a token
PER_TOKEN = 2 * LAYERS * HEADS * HEAD * BF16.itemsize


def llama_8b_cache(block_size: int = 16) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=BF16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layers, spec)])  # fmt: skip


def test_a_prompt_that_fills_the_context_fits_in_any_decode_s_block_size():
    config = make_vllm_config("kv_producer")
    config.model_config.max_model_len = 8192
    sized = sized_staging(parse_config({}), config, llama_8b_cache())
    pool = StagingPool(sized.num_staging_pages, sized.staging_page_bytes, lease_s=60.0)
    for decode_block in (16, 128, 1024):
        staged = StagingFormat("LBHNC", KVGeometry(HEADS, HEAD, decode_block, BF16), LAYERS)
        assert pool.allocate(f"r{decode_block}", HEADER_BYTES + staged.request_bytes(8192)) == 0
        pool.release(f"r{decode_block}")
    assert 8192 * PER_TOKEN < sized.pool_bytes <= (8192 + 1024 + 16) * PER_TOKEN + (1 << 20)
    # The 256 MiB of old held 2,048 of these tokens.
    assert DEFAULT_STAGING_BYTES // PER_TOKEN == 2048


def test_a_small_model_keeps_the_floor_and_a_set_size_is_kept_and_logged(caplog):
    config = make_vllm_config("kv_producer")
    assert sized_staging(parse_config({}), config, make_kv_cache_config(16)).pool_bytes == (
        DEFAULT_STAGING_BYTES
    )
    config.model_config.max_model_len = 8192
    with caplog.at_level(logging.WARNING):
        kept = sized_staging(parse_config({"staging_bytes": 1 << 28}), config, llama_8b_cache())
    assert kept.pool_bytes == 1 << 28
    held = ((1 << 28) - kept.staging_page_bytes) // PER_TOKEN - MAX_BLOCK_TOKENS  # 1,022
    assert f"holds prompts of at least {held} tokens" in caplog.text


def test_unasked_the_pool_stops_at_4_gib_and_says_how_long_a_prompt_it_holds(caplog):
    config = make_vllm_config("kv_producer")
    config.model_config.max_model_len = 131072  # Llama-3.1-8B's own
    with caplog.at_level(logging.WARNING):
        sized = sized_staging(parse_config({}), config, llama_8b_cache())
    assert sized.pool_bytes == MAX_AUTO_STAGING
    held = (MAX_AUTO_STAGING - sized.staging_page_bytes) // PER_TOKEN - MAX_BLOCK_TOKENS
    assert f"holds prompts of at least {held} tokens, not max_model_len=131072" in caplog.text
