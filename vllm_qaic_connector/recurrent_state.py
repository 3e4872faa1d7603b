"""Recurrent state of SSM (Mamba) layers, staged after a request's KV.

A Mamba layer keeps no per-token KV: one block per request holds the layer's whole state
after the request's last computed token (vLLM's ``mamba_cache_mode="none"``). A handoff
copies that block's tensors as bytes. Nothing here imports vLLM or does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 64  # the state starts aligned in staging, so any dtype can view it in place


def state_offset(kv_bytes: int) -> int:
    """Where the state starts in a staged request whose KV takes ``kv_bytes``."""
    return -(-kv_bytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class RecurrentState:
    """Each SSM layer's state tensors (``[blocks, ...]``, e.g. conv and SSM state) and the
    KV cache group whose block holds a request's state."""

    layers: tuple[tuple[torch.Tensor, ...], ...]
    groups: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """One request's state, every layer."""
        return sum(t[0].numel() * t.element_size() for layer in self.layers for t in layer)

    def signature(self) -> tuple[str, ...]:
        """Shapes and dtypes of one layer's state: what two engines must share."""
        return tuple(
            "+".join(f"{'x'.join(map(str, t.shape[1:]))}:{t.dtype}" for t in layer)
            for layer in self.layers
        )

    def _pairs(
        self, block_ids: Sequence[Sequence[int]], region: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(a layer's state tensor in the request's block, its bytes in ``region``)."""
        if region.numel() != self.nbytes:
            raise ValueError(f"state region of {region.numel()} B, the state is {self.nbytes} B")
        pairs, at = [], 0
        for layer, group in zip(self.layers, self.groups, strict=True):
            if not block_ids[group]:
                raise ValueError(f"no state block in KV cache group {group}")
            block = block_ids[group][0]  # the running state ("none" mode: the only block)
            for t in layer:
                n = t[0].numel() * t.element_size()
                pairs.append((t[block], region[at : at + n].view(t.dtype).view(t.shape[1:])))
                at += n
        return pairs

    def save(self, block_ids: Sequence[Sequence[int]], region: torch.Tensor) -> int:
        """Copies the request's state into ``region`` (flat uint8); returns bytes copied."""
        for state, staged in self._pairs(block_ids, region):
            staged.copy_(state)
        return self.nbytes

    def load(self, region: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> int:
        for state, staged in self._pairs(block_ids, region):
            state.copy_(staged)
        return self.nbytes

    def zero(self, block_ids: Sequence[Sequence[int]]) -> None:
        """Negative control: forget a loaded state."""
        for layer, group in zip(self.layers, self.groups, strict=True):
            for t in layer:
                t[block_ids[group][0]].zero_()
