"""Builds a real vLLM Scheduler that runs QAICConnector's scheduler half, and steps it
with ModelRunnerOutputs in place of a model (the scheduler never looks at tensors)."""

from __future__ import annotations

import time
from typing import Any, Literal

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import vllm_qaic_connector
from testbed.shipped_model import MODEL_DIR, TINY
from vllm_qaic_connector.protocol.ticket import prompt_hash
from vllm_qaic_connector.step_metadata import QAICConnectorMetadata

MODEL = str(MODEL_DIR)
EOS = TINY.eos
MAMBA_SHAPES = ((3, 640), (8, 64, 64))  # conv state, SSM state of one Mamba2 layer

BS = 16  # the tests' block size

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


def make_vllm_config(
    role: KVRole,
    block_size: int = 16,
    extra: dict[str, Any] | None = None,
    engine_id: str = "eng",
    max_batched: int = 1024,
    dp_index: int = 0,
    prefix_caching: bool = True,
    max_num_seqs: int = 16,
    load_failure_policy: Literal["recompute", "fail"] = "fail",
) -> VllmConfig:
    """``dp_index``: the data-parallel rank this engine is (vLLM sets it per DP engine)."""
    vllm_qaic_connector.register()
    cfg = VllmConfig(
        model_config=ModelConfig(model=MODEL, max_model_len=1024, seed=0, dtype="float32"),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="QAICConnector",
            kv_role=role,
            engine_id=engine_id,
            kv_connector_extra_config=extra or {},
            kv_load_failure_policy=load_failure_policy,
        ),
    )
    cfg.parallel_config.data_parallel_index = dp_index
    return cfg


def make_kv_cache_config(
    block_size: int, num_blocks: int = 64, window: int = 0, mamba: bool = False
) -> KVCacheConfig:
    """Two full-attention layers; with ``window``, a hybrid model as vLLM's HMA groups it:
    layers 0 and 2 sliding-window (group 0), layers 1 and 3 full attention (group 1). With
    ``mamba``, layers 0 and 2 are Mamba2 layers instead (state shapes, and one state block
    per request, as vLLM gives the random GraniteMoeHybrid of scripts/make_random_model.py)."""
    geo: dict[str, Any] = dict(
        block_size=block_size,
        num_kv_heads=TINY.kv_heads,
        head_size=TINY.head_size,
        dtype=getattr(torch, TINY.dtype),
    )
    layer = "model.layers.{}.self_attn.attn".format
    groups = [KVCacheGroupSpec([layer(0), layer(1)], FullAttentionSpec(**geo))]
    if window:
        groups = [
            KVCacheGroupSpec([layer(0), layer(2)], SlidingWindowSpec(**geo, sliding_window=window)),
            KVCacheGroupSpec([layer(1), layer(3)], FullAttentionSpec(**geo)),
        ]
    if mamba:
        state = MambaSpec(
            block_size=8 * block_size, shapes=MAMBA_SHAPES, dtypes=(torch.float32,) * 2
        )
        mixer = "model.layers.{}.mixer".format
        groups = [
            KVCacheGroupSpec([mixer(0), mixer(2)], state),
            KVCacheGroupSpec([layer(1), layer(3)], FullAttentionSpec(**geo)),
        ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],  # the scheduler never allocates; workers do
        kv_cache_groups=groups,
    )


def make_scheduler(
    role: KVRole,
    block_size: int = 16,
    extra: dict[str, Any] | None = None,
    num_blocks: int = 64,
    window: int = 0,
    mamba: bool = False,
    **kw: Any,
) -> Scheduler:
    cfg = make_vllm_config(role, block_size, extra, **kw)
    cfg.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        cfg,
        make_kv_cache_config(block_size, num_blocks, window, mamba),
        StructuredOutputManager(cfg),
        block_size=8 * block_size if mamba else block_size,  # the groups' LCM, as vLLM's
        hash_block_size=block_size,
    )


def make_request(
    rid: str,
    num_tokens: int,
    params: dict[str, Any] | None = None,
    max_tokens: int = 1,
    block_size: int = 16,
    first: int = 5,
) -> Request:
    init_none_hash(sha256)
    req = Request(
        rid,
        [first + (i % 200) for i in range(num_tokens)],
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = params
    return req


def step(
    sched: Scheduler,
    connector_output: KVConnectorOutput | None = None,
    token: int = 7,
    worker_frees: bool = False,
) -> tuple[SchedulerOutput, dict[int, Any]]:
    """One scheduler step; every request whose prompt completes samples ``token``.
    ``worker_frees``: the worker reports the direct handoffs released in this step as
    finished sending, as a real worker does within the step."""
    out = sched.schedule()
    if worker_frees and (released := meta(out).release_direct):
        connector_output = KVConnectorOutput(finished_sending=set(released))
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = sched.requests[rid]
        done = req.num_computed_tokens >= req.num_prompt_tokens
        sampled.append([token] if done else [])
    runner = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=connector_output,
    )
    return out, sched.update_from_output(out, runner)


def meta(out) -> QAICConnectorMetadata:
    assert isinstance(out.kv_connector_metadata, QAICConnectorMetadata)
    return out.kv_connector_metadata


def free_blocks(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def params_of(engine_outputs, rid: str) -> dict | None:
    for outs in engine_outputs.values():
        for o in outs.outputs:
            if o.request_id == rid:
                return o.kv_transfer_params
    return None


def remote_params(n: int, first: int = 5, port: int = 1, lease_s: float = 120.0) -> dict:
    """What a prefill returns for ``make_request(..., n, first=first)``'s prompt."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "eng",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_request_id": "p1",
        "num_tokens": n,
        "staging_offset": 0,
        "staged_layout": "vllm_cpu_vec",
        "staged_block_size": 128,
        "incarnation": "feedfacefeedface",
        "generation": 1 << 32,
        "prompt_hash": prompt_hash(make_request("x", n, first=first).prompt_token_ids or []),
        "lease_s": lease_s,
        "expires_at": time.time() + lease_s,
    }
