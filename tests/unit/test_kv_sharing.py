"""Layers that read another layer's KV (vLLM's cross-layer KV sharing,
``kv_sharing_target_layer_name``: Gemma-3n, Gemma 4's ``num_kv_shared_layers``). vLLM gives
such a layer no KV cache spec, so the KV cache groups, and the staging the scheduler half
reserves from them, leave it out; but the model runner registers it with the connector
under its own name, its target's cache again (`GPUModelRunner.initialize_kv_cache_tensors`).
"""

from __future__ import annotations

import os

import pytest
import torch
from vllm.distributed import parallel_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from testbed.vllm_harness import make_request, make_vllm_config, meta, step
from vllm_qaic_connector.connector import QAICConnector

BS, PAGE, CANARY = 16, 4096, 0xAB
LAYER = "model.layers.{}.self_attn.attn".format
SHARED = {LAYER(2): LAYER(0), LAYER(3): LAYER(1)}  # each reads its kind's last own layer


@pytest.fixture
def prefill(monkeypatch):
    """A prefill engine's two halves over vLLM's own structures for a Gemma-4-like model:
    layers 0 (sliding window) and 1 (full attention) with KV of their own, 2 and 3 reading
    theirs. The specs are what vLLM's model runner reports (none for 2 and 3), the KV cache
    config the engine core builds from them, the caches allocated as the runner allocates
    them, then 2 and 3 given their targets' caches, as the runner does."""
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    extra = {"staging_page_bytes": PAGE, "staging_bytes": 256 * PAGE, "async_saves": False}
    config = make_vllm_config("kv_producer", BS, extra, engine_id=f"kvs{os.getpid()}")
    record_kv_cache_layout(config.cache_config, "LBHNC")  # the CPU backend's, as resolved
    geo = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    own = SlidingWindowSpec(**geo, sliding_window=32), FullAttentionSpec(**geo)
    specs = {LAYER(i): spec for i, spec in enumerate(own)}
    [kv_cache_config] = get_kv_cache_configs(config, [specs], [8 << 20])
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
    caches.update((name, caches[target]) for name, target in SHARED.items())
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    sched = Scheduler(
        config, kv_cache_config, StructuredOutputManager(config), block_size=BS,
        hash_block_size=BS,
    )  # fmt: skip
    worker = QAICConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        worker.register_kv_caches(caches)
        sched.connector.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
        yield sched, worker
    finally:
        worker.shutdown()
        sched.connector.shutdown()


def test_a_layer_reading_anothers_kv_is_staged_once_within_what_the_scheduler_reserved(prefill):
    """The worker stages each physical cache once, the layers the scheduler reserved
    staging for; before, it staged all four and wrote past the request's pages (into the
    next request's). A decode registers the same two, so it loads what 2 and 3 read."""
    sched, worker = prefill
    rank = worker.worker.rank_meta
    assert rank.layers == (LAYER(0), LAYER(1)) and rank.num_layers == 2
    sched.add_request(make_request("p1", 100, {"do_remote_decode": True}))
    out, _ = step(sched)
    (save,) = meta(out).saves
    staging = worker.worker.transport.staging
    staging.fill_(CANARY)
    worker.bind_connector_metadata(meta(out))
    worker.wait_for_save()
    reserved = sched.connector.scheduler.pool.pages_in_use * PAGE
    assert save.staging_offset == 0 and 0 < reserved < staging.numel()
    assert bool((staging[reserved:] == CANARY).all()), "staged past the reserved pages"
    assert bool((staging[:reserved] != CANARY).any())  # it did stage
