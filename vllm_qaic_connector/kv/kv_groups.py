"""KV cache groups (vLLM's hybrid allocator, HMA): what each group is, and which of a
request's tokens a handoff moves for it.

A full-attention group moves the whole prompt. A sliding-window group moves only the tail
the decode will attend to: vLLM drops (and never allocates on the decode) the blocks before
it. A Mamba group moves one block per request, its recurrent state. The math is pure;
``groups_of`` is the one place that reads vLLM's specs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_qaic_connector.layout import KVGeometry

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class KVGroup:
    block_size: int
    window: int  # tokens a sliding-window layer keeps (0: full attention)
    layer_names: tuple[str, ...]
    state_bytes: int = 0  # Mamba: one layer's recurrent state per request (0: attention)


def groups_of(kv_cache_config: KVCacheConfig) -> tuple[KVGroup, ...]:
    """The engine's KV cache groups; refuses kinds whose KV this connector cannot move."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    groups, shapes = [], set()
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec, names = group.kv_cache_spec, tuple(group.layer_names)
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "none" or spec.num_speculative_blocks:
                raise ValueError(
                    f"QAICConnector: KV cache group {i} keeps Mamba state in mode "
                    f"{spec.mamba_cache_mode!r} with {spec.num_speculative_blocks} speculative "
                    "blocks; only one state block per request (mode 'none', no speculative "
                    "decoding, so --no-enable-prefix-caching) can be handed off"
                )
            groups.append(KVGroup(spec.block_size, 0, names, spec.state_content_size_bytes))
            continue
        if not isinstance(spec, AttentionSpec) or isinstance(spec, ChunkedLocalAttentionSpec):
            raise ValueError(
                f"QAICConnector: KV cache group {i} is {type(spec).__name__}; only full and "
                "sliding-window attention and Mamba groups can be handed off"
            )
        shapes.add((spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype))
        window = 0
        if isinstance(spec, SlidingWindowSpec):
            window = spec.sliding_window + spec.extra_retained_tokens
        groups.append(KVGroup(spec.block_size, window, names))
    if len(shapes) > 1:
        raise ValueError(
            f"QAICConnector: KV cache groups differ in (block size, KV heads, head size, "
            f"dtype): {sorted(shapes, key=str)}; they must share one geometry"
        )
    return tuple(groups)


def attention_geometry(kv_cache_config: KVCacheConfig) -> KVGeometry:
    """The first attention group's geometry: the one every KV group shares. An MLA latent
    is one head whose K and V are its halves (`layout.MlaLatentLayout`)."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    specs = (g.kv_cache_spec for g in kv_cache_config.kv_cache_groups)
    s: Any = next(s for s in specs if not isinstance(s, MambaSpec))  # an attention spec
    if isinstance(s, MLAAttentionSpec):
        if s.head_size % 2:
            raise ValueError(f"QAICConnector: an MLA latent of {s.head_size} values does not halve")
        return KVGeometry(1, s.head_size // 2, s.block_size, s.dtype)
    return KVGeometry(s.num_kv_heads, s.head_size, s.block_size, s.dtype)


def has_state(groups: Sequence[KVGroup]) -> bool:
    return any(g.state_bytes for g in groups)


def state_bytes(groups: Sequence[KVGroup]) -> int:
    """One request's recurrent state, every Mamba layer (on one TP rank)."""
    return sum(g.state_bytes * len(g.layer_names) for g in groups)


def window_start(num_tokens: int, window: int) -> int:
    """The first token a layer attends to when token ``num_tokens`` is computed: vLLM's
    ``SlidingWindowManager.get_num_skipped_tokens``; 0 for full attention."""
    return max(0, num_tokens - window + 1) if window else 0


def tokens_to_load(num_tokens: int, groups: Sequence[KVGroup]) -> int:
    """How many staged tokens a decode claims. With a recurrent state, all of them: the
    state is that of the last one (the prefill stopped a token short). Otherwise with a
    sliding window, one short: vLLM recomputes the last prompt token of a fully loaded
    prompt, and that token attends one token further back than the blocks vLLM keeps for
    the whole prompt."""
    one_short = any(g.window for g in groups) and num_tokens > 1 and not has_state(groups)
    return num_tokens - 1 if one_short else num_tokens


def kept_start(num_tokens: int, window: int, block_size: int) -> int:
    """The first token of the first block an engine keeps for a request of ``num_tokens``
    (the blocks before it are vLLM's null block)."""
    start = window_start(num_tokens, window)
    return start - start % block_size


def staged_starts(
    groups: Sequence[KVGroup], num_tokens: int, staged_block_size: int, held: Sequence[int]
) -> tuple[int, ...]:
    """The first token staged per group: whole blocks of the staging block size from the
    window's start, but nothing before what the prefill still holds (``held``)."""
    loaded = tokens_to_load(num_tokens, groups)
    return tuple(
        max(kept_start(loaded, g.window, staged_block_size), h)
        for g, h in zip(groups, held, strict=True)
    )


def load_starts(groups: Sequence[KVGroup], num_tokens: int, first_token: int) -> tuple[int, ...]:
    """The first token to load per group: the decode's first kept block, or the first
    token it has not computed itself, whichever is later."""
    return tuple(max(kept_start(num_tokens, g.window, g.block_size), first_token) for g in groups)


def staging_gap(loads: Sequence[int], staged: Sequence[int]) -> str | None:
    """Why staged tokens cannot fill the blocks a decode loads, or None. A half-written
    block must not be loaded: the prefix cache would later hand it to another request."""
    if len(staged) != len(loads):
        return f"the ticket stages {len(staged)} KV cache groups, this engine has {len(loads)}"
    for i, (load, begin) in enumerate(zip(loads, staged, strict=True)):
        if begin > load:
            return f"KV cache group {i}: staged from token {begin}, needed from {load}"
    return None


def held_start(block_ids: Sequence[int], null_block_id: int, block_size: int) -> int:
    """The first token in a real block (vLLM pads dropped sliding-window blocks with its
    null block)."""
    skipped = next((i for i, b in enumerate(block_ids) if b != null_block_id), len(block_ids))
    return skipped * block_size


def layer_groups(groups: Sequence[KVGroup], layer_names: Sequence[str]) -> tuple[int, ...]:
    """The group of each layer, in the order given (a layer in no group: group 0)."""
    group_of = {name: i for i, g in enumerate(groups) for name in g.layer_names}
    return tuple(group_of.get(name, 0) for name in layer_names)


def layer_starts(group_starts: Sequence[int], groups_of_layers: Sequence[int]) -> tuple[int, ...]:
    """Each layer's first staged token, from its group's (`layer_groups`); empty where every
    layer stages from token 0."""
    firsts = tuple(group_starts[g] for g in groups_of_layers)
    return firsts if any(firsts) else ()


def ordered_layers(groups: Sequence[KVGroup], state: bool = False) -> list[str]:
    """Every attention layer (or with ``state``, every Mamba layer) `in_layer_order`."""
    return in_layer_order(n for g in groups if bool(g.state_bytes) == state for n in g.layer_names)


def in_layer_order(names: Iterable[str]) -> list[str]:
    """The order both sides stage layers in: by index in the model, ties (a drafter's layer
    i beside the target's) by full name; never a set's order, which follows each
    process's string-hash seed."""
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted(names, key=lambda n: (extract_layer_index(n), n))
