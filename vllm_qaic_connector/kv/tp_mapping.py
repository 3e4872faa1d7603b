"""Which prefill ranks hold the KV heads a decode rank needs. Pure; computed per load."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_qaic_connector.kv.token_copies import HeadRange


def heads_of_rank(total_heads: int, tp_size: int, rank: int) -> range:
    """KV heads held by ``rank``, as vLLM shards them. With fewer heads than ranks, each
    rank holds one head and neighbouring ranks replicate it."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for TP {tp_size}")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} KV heads do not split over TP {tp_size}")
        per = total_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank * total_heads // tp_size
    return range(head, head + 1)


def head_sources(
    total_heads: int, src_tp: int, dst_tp: int, dst_rank: int, among: Sequence[int] = ()
) -> dict[int, HeadRange]:
    """The minimal set of reads that fill one decode rank: each prefill rank read, in rank
    order, with its heads to read (local to it, placed at ``dst_start`` locally). A head
    replicated on several prefill ranks is read once, from the first (of ``among``, when
    given: the ranks read anyway)."""
    want = heads_of_rank(total_heads, dst_tp, dst_rank)
    sources: dict[int, HeadRange] = {}
    next_head = want.start
    for src in among or range(src_tp):
        have = heads_of_rank(total_heads, src_tp, src)
        lo, hi = max(next_head, have.start), min(want.stop, have.stop)
        if lo < hi:
            sources[src] = HeadRange(lo - have.start, hi - have.start, lo - want.start)
            next_head = hi
    if next_head != want.stop:
        raise ValueError(f"TP {src_tp}->{dst_tp}: no prefill rank holds heads {next_head}..")
    return sources


def overlapping_ranks(src_tp: int, dst_tp: int, dst_rank: int) -> list[int]:
    """Prefill ranks whose share of an evenly split dimension overlaps the decode rank's:
    where a decode rank finds its part of a recurrent state (split by Mamba heads)."""
    return [r for r in range(src_tp) if r * dst_tp < (dst_rank + 1) * src_tp
            and (r + 1) * dst_tp > dst_rank * src_tp]  # fmt: skip


def source_ranks(
    total_heads: int, src_tp: int, dst_tp: int, dst_rank: int, state: bool = False
) -> list[int]:
    """Every prefill rank a decode rank reads: those holding its KV heads and, for a model
    with recurrent state, those holding part of its state."""
    ranks = set(head_sources(total_heads, src_tp, dst_tp, dst_rank))
    if state:
        ranks.update(overlapping_ranks(src_tp, dst_tp, dst_rank))
    return sorted(ranks)


def reads_needed(
    total_heads: int, src_tp: int, dst_tp: int, state: bool = False
) -> frozenset[tuple[int, int]]:
    """Every (decode rank, prefill rank) read a handoff between these TP sizes takes."""
    return frozenset(
        (dst, src)
        for dst in range(dst_tp)
        for src in source_ranks(total_heads, src_tp, dst_tp, dst, state)
    )
