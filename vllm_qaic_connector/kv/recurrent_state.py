"""Recurrent state of SSM (Mamba) layers, staged after a request's KV.

A Mamba layer keeps no per-token KV: one block per request holds the layer's whole state
after the request's last computed token (vLLM's ``mamba_cache_mode="none"``). A handoff
copies that block's tensors as bytes, each rank its own shard; a decode rank with another
TP size gathers its shard from the prefill ranks' (``Split``). Nothing here imports vLLM or
does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_qaic_connector.kv.tp_mapping import head_sources, heads_of_rank, overlapping_ranks


@dataclass(frozen=True)
class Split:
    """How one state tensor divides over TP ranks: along ``axis`` of a block's shape, a run
    of segments of ``(units, width)``: ``units`` of ``width`` elements, sharded like KV
    heads (replicated when there are fewer units than ranks)."""

    axis: int
    segments: tuple[tuple[int, int], ...]

    def length(self, tp: int, rank: int) -> int:
        """The axis's length on ``rank`` of ``tp``."""
        return sum(len(heads_of_rank(u, tp, rank)) * w for u, w in self.segments)

    def shape(self, block: Sequence[int], tp: int, rank: int) -> tuple[int, ...]:
        """A block's shape ``block`` with the axis's length on ``rank`` of ``tp``."""
        return tuple(self.length(tp, rank) if a == self.axis else n for a, n in enumerate(block))

    def runs(
        self, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int
    ) -> list[tuple[int, int, int]]:
        """``(src_start, dst_start, length)`` along the axis: what the decode rank takes
        from this prefill rank. Only ranks whose share overlaps its own are read."""
        among = overlapping_ranks(src_tp, dst_tp, dst_rank)
        runs, src_at, dst_at = [], 0, 0
        for units, width in self.segments:
            if h := head_sources(units, src_tp, dst_tp, dst_rank, among).get(src_rank):
                runs.append((src_at + h.start * width, dst_at + h.dst_start * width,
                             (h.stop - h.start) * width))  # fmt: skip
            src_at += len(heads_of_rank(units, src_tp, src_rank)) * width
            dst_at += len(heads_of_rank(units, dst_tp, dst_rank)) * width
        return runs


def mamba2_splits(
    shapes: Sequence[Sequence[int]], heads: int, head_dim: int, groups: int, d_state: int,
    tp: int,
) -> tuple[Split, Split] | None:  # fmt: skip
    """Mamba2's (conv, SSM) splits, or None where the shapes are not Mamba2's at this TP.
    The conv state's channel axis holds x, B and C (vLLM's DS or SD orientation); the SSM
    state is ``[heads, head_dim, d_state]``."""
    conv, ssm = (tuple(s) for s in shapes)
    channels = Split(0, ((heads, head_dim), (groups, d_state), (groups, d_state)))
    axes = [a for a in (0, 1) if len(conv) == 2 and conv[a] == channels.length(tp, 0)]
    if len(axes) != 1 or heads % tp or ssm != (heads // tp, head_dim, d_state):
        return None
    return Split(axes[0], channels.segments), Split(0, ((heads, 1),))


def mixer_splits(
    mixer: Any, tensors: Sequence[torch.Tensor], groups: int | None, tp: int
) -> tuple[Split, ...] | None:
    """The splits of a Mamba layer's state tensors (``[blocks, ...]``), read off its vLLM
    mixer; None where unknown (not Mamba2, or ``groups``, the model's B/C groups, unknown)."""
    dims = [getattr(mixer, a, None) for a in ("num_heads", "head_dim", "ssm_state_size")]
    if len(tensors) != 2 or groups is None or not all(isinstance(d, int) for d in dims):
        return None
    heads, head_dim, d_state = (int(d) for d in dims)  # type: ignore[arg-type]
    return mamba2_splits([t.shape[1:] for t in tensors], heads, head_dim, groups, d_state, tp)


def state_tensors(
    name: str, caches: dict[str, Any], modules: dict[str, Any]
) -> tuple[torch.Tensor, ...]:
    # vLLM hands a connector a Mamba layer's raw allocation; the layer itself holds the
    # state views (conv, SSM) its kernels use.
    module = modules.get(name)
    state = module.kv_cache if module is not None else caches[name]
    if not isinstance(state, (list, tuple)) or not all(
        isinstance(t, torch.Tensor) and t.dim() >= 2 for t in state
    ):
        raise TypeError(f"QAICConnector: cannot read the state tensors of Mamba layer {name}")
    return tuple(state)


@dataclass(frozen=True)
class RecurrentState:
    """Each SSM layer's state tensors (``[blocks, ...]``, e.g. conv and SSM state), the KV
    cache group whose block holds a request's state, and how each tensor splits over TP
    ranks (empty: unknown, so only an engine of the same TP size can take it)."""

    layers: tuple[tuple[torch.Tensor, ...], ...]
    groups: tuple[int, ...]
    splits: tuple[tuple[Split, ...], ...] = ()
    tp_size: int = 1
    tp_rank: int = 0
    _splits: tuple[tuple[Split, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        whole = tuple(
            tuple(Split(0, ((self.tp_size, t.shape[1]),)) for t in layer) for layer in self.layers
        )
        object.__setattr__(self, "_splits", self.splits or whole)

    @classmethod
    def of_layers(
        cls, names: Sequence[str], caches: dict[str, Any], modules: dict[str, Any],
        groups: tuple[int, ...], ssm_groups: int | None, tp_size: int, tp_rank: int,
    ) -> RecurrentState:  # fmt: skip
        """The state of the Mamba layers ``names``, from vLLM's registered ``caches`` and
        layer ``modules``; each layer's KV cache group; the model's B/C groups."""
        states = [state_tensors(n, caches, modules) for n in names]
        splits = [
            mixer_splits(modules.get(n), t, ssm_groups, tp_size)
            for n, t in zip(names, states, strict=True)
        ]
        known = () if None in splits else tuple(s for s in splits if s is not None)
        return cls(tuple(states), groups, known, tp_size, tp_rank)

    def nbytes(self, tp: int | None = None, rank: int | None = None) -> int:
        """One request's state, every layer, on a rank (by default this one)."""
        return sum(math.prod(shape) * t.element_size() for t, _, shape in self._tensors(tp, rank))

    def signature(self) -> tuple[str, ...]:
        """What two engines must share: global shapes, dtypes and splits, so independent
        of TP where the splits are known."""
        return tuple(
            "+".join(
                f"{'x'.join(map(str, s.shape(t.shape[1:], 1, 0)))}:{t.dtype}:{s.segments}"
                for t, s in zip(layer, splits, strict=True)
            )
            for layer, splits in zip(self.layers, self._splits, strict=True)
        )

    def _tensors(
        self, tp: int | None, rank: int | None
    ) -> Iterator[tuple[torch.Tensor, Split, tuple[int, ...]]]:
        """(state tensor, its split, one block's shape on ``rank`` of ``tp``)."""
        tp, rank = tp or self.tp_size, self.tp_rank if rank is None else rank
        for layer, splits in zip(self.layers, self._splits, strict=True):
            for t, split in zip(layer, splits, strict=True):
                yield t, split, split.shape(t.shape[1:], tp, rank)

    def _staged(
        self, block_ids: Sequence[Sequence[int]], region: torch.Tensor, tp: int, rank: int
    ) -> Iterator[tuple[torch.Tensor, Split, torch.Tensor]]:
        """(a layer's state tensor in the request's block, its split, its bytes in
        ``region`` as staged by ``rank`` of ``tp``)."""
        if region.numel() != self.nbytes(tp, rank):
            raise ValueError(f"state region of {region.numel()} B, the state is "
                             f"{self.nbytes(tp, rank)} B")  # fmt: skip
        at, tensors = 0, self._tensors(tp, rank)
        for layer, group in zip(self.layers, self.groups, strict=True):
            if not block_ids[group]:
                raise ValueError(f"no state block in KV cache group {group}")
            block = block_ids[group][0]  # the running state ("none" mode: the only block)
            for _ in layer:
                t, split, shape = next(tensors)
                n = math.prod(shape) * t.element_size()
                yield t[block], split, region[at : at + n].view(t.dtype).view(shape)
                at += n

    def save(self, block_ids: Sequence[Sequence[int]], region: torch.Tensor) -> int:
        """Copies the request's state into ``region`` (flat uint8); returns bytes copied."""
        for state, _, staged in self._staged(block_ids, region, self.tp_size, self.tp_rank):
            staged.copy_(state)
        return region.numel()

    def load(
        self, region: torch.Tensor, block_ids: Sequence[Sequence[int]], src_tp: int, src_rank: int
    ) -> int:
        """Takes this rank's part of what ``src_rank`` of ``src_tp`` staged; returns bytes
        copied."""
        copied = 0
        for state, split, staged in self._staged(block_ids, region, src_tp, src_rank):
            for s_at, d_at, n in split.runs(src_tp, src_rank, self.tp_size, self.tp_rank):
                part = staged.narrow(split.axis, s_at, n)
                state.narrow(split.axis, d_at, n).copy_(part)
                copied += part.numel() * part.element_size()
        return copied

    def zero(self, block_ids: Sequence[Sequence[int]]) -> None:
        """Negative control: forget a loaded state."""
        for layer, group in zip(self.layers, self.groups, strict=True):
            for t in layer:
                t[block_ids[group][0]].zero_()
