"""The format a prefill stages a request in for its decode: the decode's layout and block
size (learnt by handshake), its own, or none at all where the decode reads its cache."""

from __future__ import annotations

import dataclasses

from vllm_qaic_connector.kv.kv_groups import KVGroup, layer_starts, staged_starts, state_bytes
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.layout import KVGeometry
from vllm_qaic_connector.protocol.wire import RankMetadata, direct_problem


@dataclasses.dataclass(frozen=True)
class StagingTarget:
    """The physical format a prefill stages a request in for its decode."""

    layout_kind: str
    block_size: int
    direct: bool = False  # the decode reads our KV cache: nothing is staged

    @classmethod
    def for_decode(
        cls, ours: list[RankMetadata], decode: list[RankMetadata], own: StagingTarget
    ) -> StagingTarget:
        """The decode's format; ``own`` where it reads our cache directly (in our format)
        or its head shards differ (it regroups heads on receive)."""
        if len(decode) != len(ours):
            return own
        if not direct_problem(ours[0], decode[0], len(ours)):
            return dataclasses.replace(own, direct=True)
        return cls(decode[0].layout_kind, decode[0].block_size)

    def largest_format(
        self,
        num_tokens: int,
        geometry: KVGeometry,
        groups: tuple[KVGroup, ...],
        layer_groups: tuple[int, ...],
    ) -> StagingFormat:
        """The most a request of ``num_tokens`` can stage: none of its blocks dropped yet."""
        starts = staged_starts(groups, num_tokens, self.block_size, (0,) * len(groups))
        n, geometry = len(layer_groups), dataclasses.replace(geometry, block_size=self.block_size)
        firsts = layer_starts(starts, layer_groups)
        return StagingFormat(self.layout_kind, geometry, n, firsts, state_bytes(groups))
