"""What the scheduler half hands the worker half each step: the saves and loads to run,
and the staging and blocks to give up. Plain data, built by `scheduler_side`, read by
`worker_side` and `request_loads`."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from vllm_qaic_connector.protocol.ticket import UNBOUND, RemotePrefill


@dataclass(frozen=True, kw_only=True)
class SaveSpec:
    """Stage tokens ``[starts[g], num_tokens)`` of each KV cache group ``g``, held in
    ``block_ids[g]``, at ``staging_offset``, laid out as ``layout_kind`` blocks of
    ``block_size`` tokens (the decode's, when it is known), under a header holding
    ``generation``. A chunked prompt is staged chunk by chunk as it is computed (a
    sliding-window group drops its early blocks before the prompt ends): this save
    copies tokens ``[first, last)`` of that range, and only the last one (generation set)
    seals the header."""

    request_id: str
    block_ids: tuple[list[int], ...]
    num_tokens: int
    staging_offset: int
    layout_kind: str
    block_size: int
    generation: int
    starts: tuple[int, ...] = (0,)
    first: int = 0
    last: int = 0  # 0: num_tokens
    direct: bool = False  # nothing to copy: the decode reads block_ids out of our cache
    binding: bytes = UNBOUND  # the final save's: what its ticket names (`ticket_binding`)


@dataclass(frozen=True, kw_only=True)
class LoadSpec:
    """Load tokens ``[starts[g], remote.num_tokens)`` of each KV cache group ``g`` into
    ``block_ids[g]`` (which cover the request from token 0). ``first_token`` is the first
    one not computed here. ``error`` set means: fail the load, report the blocks."""

    request_id: str
    block_ids: tuple[list[int], ...]
    first_token: int
    remote: RemotePrefill | None
    error: str | None = None
    holds_until: float = 0.0  # unix time the staging lease is known to hold (0: unchecked)
    starts: tuple[int, ...] = ()  # empty: first_token for every group
    claimed: int = 0  # tokens claimed from the prefill (0: all it staged)
    in_step: bool = False  # loaded before this step's forward pass, not reported finished

    def start(self, group: int) -> int:
        return self.starts[group] if self.starts else self.first_token

    @property
    def end(self) -> int:
        return self.claimed or (self.remote.num_tokens if self.remote else 0)


@dataclass
class QAICConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # Staged regions given up (released, expired) whose headers the worker invalidates.
    invalidate: list[int] = field(default_factory=list)
    # Finished requests whose blocks vLLM holds until the worker's saves from them are
    # done: the worker reports each as finished sending then.
    await_saves: list[str] = field(default_factory=list)
    # Requests handed off directly whose tickets are gone: the worker reports them finished
    # sending (vLLM frees their blocks) after it invalidated this step's ``invalidate``.
    release_direct: list[str] = field(default_factory=list)
    # Requests preempted this step with saves behind them: vLLM freed their blocks, and
    # this step's forward may write others' KV there, so those saves finish first.
    preempted: list[str] = field(default_factory=list)
    # Nothing is computed this step: the worker may wait a moment for this step's loads,
    # so a quick one is reported now rather than after another engine step.
    idle: bool = False
