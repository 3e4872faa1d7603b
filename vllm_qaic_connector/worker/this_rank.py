"""This worker rank: who it is (what its handshake says) and the KV cache vLLM gave it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_qaic_connector.kv.kv_groups import layer_starts
from vllm_qaic_connector.kv.recurrent_state import RecurrentState
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.layout import KVGeometry, KVLayout

Views = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RankIdentity:
    """Who this worker is; everything the handshake says besides the layout."""

    engine_id: str
    tp_rank: int
    tp_size: int
    total_kv_heads: int
    model: str
    weights: str = ""  # model_weights.checkpoint_fingerprint ("": none on this host)
    produces: bool = True  # stages KV for others (kv_producer, kv_both)
    ssm_groups: int | None = None  # Mamba2's B/C groups in the model (None: unknown)
    drafter: str = ""  # the speculative drafter's method and weights ("": none)


@dataclass(frozen=True)
class LocalCache:
    """The registered KV cache: what saves read and loads write."""

    layout: KVLayout
    geometry: KVGeometry
    layers: list[Views]  # each attention layer's canonical K and V views
    tensors: list[torch.Tensor]  # physical, as vLLM registered them
    layer_groups: tuple[int, ...] = ()  # each layer's KV cache group (empty: one group)
    state: RecurrentState | None = None  # Mamba layers' state, if the model has any
    names: tuple[str, ...] = ()  # each layer's name in vLLM, in the order peers share

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    def group(self, layer: int) -> int:
        return self.layer_groups[layer] if self.layer_groups else 0

    def staging_format(
        self,
        kind: str,
        geometry: KVGeometry,
        num_layers: int,
        group_starts: tuple[int, ...],
        tp: tuple[int, int] | None = None,
    ) -> StagingFormat:
        """A staged request's format; ``group_starts``: its first staged token per group;
        ``tp``: (size, rank) of the rank that staged it, if not this one."""
        firsts = layer_starts(group_starts, self.layer_groups, num_layers)
        state = self.state.nbytes(*(tp or (None, None))) if self.state else 0
        return StagingFormat(kind, geometry, num_layers, firsts, state)
