"""One staged request's bytes: its KV laid out as [layers][physical blocks] in a flat
region, in the layout and block size the decode reads, then any recurrent state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_qaic_connector.layout import KV, KVGeometry, blocks_for_tokens, get_layout

STATE_ALIGN = 64  # the state starts aligned in staging, so any dtype can view it in place


def state_offset(kv_bytes: int) -> int:
    """Where the recurrent state starts in a staged request whose KV takes ``kv_bytes``."""
    return -(-kv_bytes // STATE_ALIGN) * STATE_ALIGN


@dataclass(frozen=True)
class StagingFormat:
    """How a staged request is laid out: the layout and geometry of its blocks. Layer ``i``
    holds its blocks from the one with token ``first_tokens[i]`` on (sliding-window layers
    stage only their tail; empty: every layer from token 0). ``state_bytes`` of recurrent
    state (Mamba layers) follow the KV."""

    layout_kind: str
    geometry: KVGeometry
    num_layers: int
    first_tokens: tuple[int, ...] = ()
    state_bytes: int = 0

    def shift(self, layer: int) -> int:
        """Tokens before a layer's first staged block (its position 0 in staging)."""
        first = self.first_tokens[layer] if self.first_tokens else 0
        return first - first % self.geometry.block_size

    def _blocks(self, layer: int, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens - self.shift(layer), self.geometry.block_size)

    def _kv_bytes(self, num_tokens: int) -> int:
        blocks = sum(self._blocks(i, num_tokens) for i in range(self.num_layers))
        return blocks * self.geometry.bytes_per_block

    def request_bytes(self, num_tokens: int) -> int:
        kv = self._kv_bytes(num_tokens)
        return state_offset(kv) + self.state_bytes if self.state_bytes else kv

    def state_region(self, region: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The recurrent state inside a staged region (flat uint8, no copy)."""
        at = state_offset(self._kv_bytes(num_tokens))
        return region[at : at + self.state_bytes]

    def layer_views(self, region: torch.Tensor, num_tokens: int) -> list[KV]:
        """Canonical views of each layer inside a staged region (flat uint8, no copy)."""
        layout = get_layout(self.layout_kind)
        views, at = [], 0
        for i in range(self.num_layers):
            nb = self._blocks(i, num_tokens)
            size = nb * self.geometry.bytes_per_block
            layer = layout.from_bytes(region[at : at + size], nb, self.geometry)
            views.append(layout.kv_views(layer, self.geometry))
            at += size
        return views
