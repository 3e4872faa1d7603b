"""A decode's finished turns, kept for the conversation's next prefill (``reuse_turns``):
each turn's blocks held under a lease and a ticket for them, as a direct handoff's are
(`KVSender` holds the blocks and writes the ticket), named for a stream's router
to ask for, its header sealed at the next step, and given up when released, expired or
evicted because running requests need the blocks. The prefill's side, the load, is
`kv_receiver`'s. Logical only: no tensors, layouts or transports."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_qaic_connector.layout import blocks_for_tokens
from vllm_qaic_connector.protocol.routed_params import RoutedParams
from vllm_qaic_connector.protocol.ticket import RemotePrefill, ticket_binding
from vllm_qaic_connector.region_headers import HEADER_BYTES, generations
from vllm_qaic_connector.scheduler.kv_receiver import tokens_alone
from vllm_qaic_connector.scheduler.kv_sender import FINISHED, KVSender
from vllm_qaic_connector.step_metadata import SaveSpec

if TYPE_CHECKING:
    from vllm.v1.request import Request


class KeptTurns:
    def __init__(self, sender: KVSender) -> None:
        self.sender, self.pool = sender, sender.pool
        self._turns: list[str] = []  # kept turns (their blocks in sender.held), oldest first
        # Tickets by the router's name for them (``turn_id``), for a stream's router to
        # ask for over the side channel (that thread only reads it).
        self.named: dict[str, RemotePrefill] = {}
        self._seals: list[SaveSpec] = []  # sealed at the next step
        self._generations = generations()

    def keep(self, request: Request, routed: RoutedParams) -> tuple[bool, Any]:
        """`request_finished` for a turn: whether its blocks stay held, and the ticket for
        the prompt and the answer's tokens but the last (whose KV was never computed), which
        the conversation's next prefill loads instead of computing. Kept where the router
        asked (``keep_turn``: it will carry the ticket back; with a ``turn_id`` it may ask
        for the ticket by that name, as a streamed answer carries none); not for an aborted
        turn, less than a block, KV in more than one full-attention group, without room,
        where its KV does not follow from its token ids alone (`tokens_alone`), or where
        its id is still staged (a repeated id, vLLM's randomization off)."""
        sender, rid = self.sender, request.request_id
        engine = sender.engine
        num_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        num_blocks = blocks_for_tokens(num_tokens, engine.geometry.block_size)
        one_group = len(engine.groups) == 1 and not engine.groups[0].window
        room = sum(sender.held.values()) + num_blocks <= sender.held_cap
        big_enough = num_tokens >= engine.geometry.block_size
        wanted = routed.keep_turn and one_group and room and big_enough
        if not wanted or not tokens_alone(request) or request.status not in FINISHED:
            return False, None
        if self.pool.has(rid) or (offset := self.pool.allocate(rid, HEADER_BYTES)) is None:
            return False, None
        assert sender.kv_cache_manager is not None
        block_ids = sender.kv_cache_manager.get_block_ids(rid)[0][:num_blocks]
        spec = SaveSpec(
            request_id=rid,
            block_ids=(list(block_ids),),
            num_tokens=num_tokens,
            staging_offset=offset,
            layout_kind=sender.ranks[0].layout_kind if sender.ranks else "",
            block_size=engine.geometry.block_size,
            generation=next(self._generations),
            direct=True,
        )
        ticket = sender.ticket(request, spec, turn=True)
        self._seals.append(dataclasses.replace(spec, binding=ticket_binding(ticket)))
        sender.held[rid] = num_blocks
        self._turns.append(rid)
        sender.stats.add("kept_turns")
        if routed.turn_id:
            self.named[routed.turn_id] = ticket
        return True, msgspec.to_builtins(ticket)

    def take_seals(self) -> list[SaveSpec]:
        """The seals of turns kept since the last step. Run after the pool's drain_freed: a
        turn released by then (evicted, released, expired) is not sealed, as its blocks go
        back to vLLM; one released later is invalidated at the next step, before its blocks
        are reported free."""
        seals, self._seals = self._seals, []
        return [seal for seal in seals if self.pool.has(seal.request_id)]

    def evict(self) -> None:
        """Kept turns give way to running requests: while fewer than an eighth of the KV
        cache's blocks are free, the oldest kept turn is released (its blocks come back at
        the next step)."""
        sender = self.sender
        assert sender.kv_cache_manager is not None
        free = sender.kv_cache_manager.block_pool.get_num_free_blocks()
        while self._turns and free < sender.engine.num_blocks // 8:
            rid = self._turns.pop(0)
            free += sender.held[rid]
            sender.stats.add("evicted_turns", self.pool.release(rid))

    def forget(self) -> None:
        """Drops turns whose blocks went (`KVSender.released_direct`) and their names."""
        held = self.sender.held
        self._turns = [rid for rid in self._turns if rid in held]
        self.named = {n: t for n, t in self.named.items() if t.remote_request_id in held}
