"""Making vLLM's KV cache readable by peers: the one allocation behind its layers, and its
description for the handshake (`SharedCache`). Each transport shares it its own way
(`KVTransport.share_kv_cache`); `worker.direct_reads` reads it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from vllm_qaic_connector.protocol.wire import SharedCache


def host_identity() -> str:
    """Boot, PID namespace and user: equal on two processes when one can open the other's
    ``/proc/<pid>/fd`` entries."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}|{os.readlink('/proc/self/ns/pid')}|{os.getuid()}"


def backing(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one allocation behind ``layers`` (host or GPU memory), as flat bytes; None where
    they do not share one storage with one shape, strides and dtype (vLLM allocates them so)."""
    first = layers[0]
    storage = first.untyped_storage()
    if any(
        t.untyped_storage().data_ptr() != storage.data_ptr()
        or (t.shape, t.stride(), t.dtype) != (first.shape, first.stride(), first.dtype)
        for t in layers
    ):
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)


def described(layers: Sequence[torch.Tensor], size: int, **where: Any) -> SharedCache:
    shape, strides = tuple(layers[0].shape), tuple(layers[0].stride())
    offsets = tuple(int(t.storage_offset()) for t in layers)
    return SharedCache(size=size, shape=shape, strides=strides, layer_offsets=offsets, **where)
