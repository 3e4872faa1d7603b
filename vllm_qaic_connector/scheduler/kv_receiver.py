"""What arrives at this engine, in the scheduler (SGLang's ``KVReceiver``): a decode's
loads, and a prefill's load of a conversation's earlier turn. A request's ticket checked,
its prompt tokens claimed (loaded beside the engine's steps; with ``sync_loads``, over
shm, in the step that runs it), its blocks handed to the worker as a `LoadSpec`, its lease
renewed while it waits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_qaic_connector.config import ConnectorConfig
from vllm_qaic_connector.kv.kv_groups import (
    KVGroup,
    has_state,
    load_starts,
    staging_gap,
    tokens_to_load,
)
from vllm_qaic_connector.logs import get_logger
from vllm_qaic_connector.model_weights import adapter_fingerprint
from vllm_qaic_connector.protocol.leases import LeaseRenewer
from vllm_qaic_connector.protocol.routed_params import RoutedParams
from vllm_qaic_connector.protocol.ticket import (
    RemotePrefill,
    field_problem,
    parse_remote_prefill,
    shared_tokens,
    ticket_problem,
)
from vllm_qaic_connector.scheduler import request_ids
from vllm_qaic_connector.scheduler.shared_tickets import SharedTickets, ticket_key
from vllm_qaic_connector.step_metadata import LoadSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = get_logger(__name__)


def tokens_alone(request: Request) -> bool:
    """Whether a request's KV follows from its token ids alone, so that a kept turn's
    ticket (a hash over token ids) can prove it: not with prompt embeddings or images (an
    image changed behind the same URL keeps its placeholder tokens)."""
    return request.prompt_token_ids is not None and not request.mm_features


class KVReceiver:
    def __init__(
        self, cfg: ConnectorConfig, groups: tuple[KVGroup, ...], prefix_caching: bool = True
    ) -> None:
        self._key, self._groups = cfg.shared_key, groups
        # A shm load is a local copy of a few ms: the worker does it before the forward pass
        # of the step that schedules the request (vLLM takes such loads' failures by block
        # only: one KV cache group). Async, its first token waits one or two more steps.
        one_group = len(groups) <= 1 and not has_state(groups)
        self._in_step = cfg.sync_loads and cfg.transport == "shm" and one_group
        self.renewer = LeaseRenewer(self._key, cfg.handshake_timeout_s)
        # request id -> (first token to load, the checked ticket, what is wrong with it)
        self._matched: dict[str, tuple[int, RemotePrefill | None, str | None]] = {}
        self._pending: dict[str, LoadSpec] = {}
        self._loading: set[str] = set()  # handed to the worker, not yet reported done
        self.tickets = SharedTickets(prefix_caching)

    def arrived(self, request: Request) -> None:
        """vLLM's ``on_new_request``: a ticket that checks out is renewed from now on, for
        however long the request queues (vLLM asks `claim` only once it looks at the
        request: a busy decode's queue outlasted leases). `claim` checks it all again."""
        if request_ids.later_prompt_of_a_list(request.request_id):
            return  # the first prompt's ticket: computed here, never read
        try:
            remote = parse_remote_prefill(request.kv_transfer_params or {})
        except ValueError:
            return
        if ticket_problem(remote, self._key) is None:
            self.renewer.want(request.request_id, remote)

    def claim(
        self,
        request: Request,
        num_computed_tokens: int,
        routed: RoutedParams,
        turn: RemotePrefill | None = None,
    ) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens`` for a ``do_remote_prefill`` request, or for
        a prefill given the ticket of the conversation's earlier ``turn`` (``reuse_turns``):
        loaded if it checks out (the prompt begins with exactly its tokens), else ignored."""
        if position := request_ids.later_prompt_of_a_list(request.request_id):
            # Its params are the first prompt's (vLLM returns no other): computed here.
            logger.info(
                "QAICConnector: request %s is prompt %d of a list, whose KV vLLM does not "
                "hand off (the first prompt's only); computing it here",
                request.request_id, position,
            )  # fmt: skip
            return 0, False
        remote: RemotePrefill | None = None
        error: str | None = None
        prompt = request.prompt_token_ids or []
        try:
            if turn is not None and not tokens_alone(request):
                raise ValueError("a turn's ticket proves token ids only: not with embeddings")
            if routed.error and turn is None:
                raise ValueError(f"nothing to load: {routed.error}")
            if turn is None:
                parsed = parse_remote_prefill(request.kv_transfer_params or {})
            elif malformed := field_problem(turn):
                raise ValueError(f"malformed earlier_turn: {malformed}")
            else:
                parsed = turn
            adapter = adapter_fingerprint(request.lora_request)
            shared = self.tickets.state(key := ticket_key(parsed), request.request_id)
            held = self.renewer.holds_until(request.request_id)  # renewed since it arrived
            # A turn's is checked whole (its MAC, its header's binding), and loads as far
            # as the prompt shares its tokens.
            unusable = ticket_problem(parsed, self._key, held, None if turn else prompt, adapter)
            if unusable:
                raise ValueError(unusable)
            num_tokens = parsed.num_tokens if turn is None else shared_tokens(parsed, prompt)
            if has_state(self._groups) and num_tokens == len(prompt):
                raise ValueError(
                    f"the prefill staged all {num_tokens} prompt tokens; a model with "
                    "Mamba layers needs it to stop at least one token short"
                )
            if shared == "busy":
                return None, False  # vLLM asks again next step
            if shared == "read":  # by a sibling (n > 1): the rest is computed here
                logger.info("QAICConnector: %s's ticket was read by another", request.request_id)
                self.renewer.drop(request.request_id)
                return 0, False
            remote = parsed  # only a ticket that checks out is used, renewed or released
            self.renewer.want(request.request_id, remote)
        except ValueError as exc:
            if turn is not None:
                logger.info("QAICConnector: %s computes its history: %s", request.request_id, exc)
                return 0, False
            # Still claim the tokens: the worker reports their blocks as load errors, so
            # vLLM's kv_load_failure_policy decides, as for every other failed load. A
            # ticket renewed since arrival is not ours to renew or release (another
            # prompt's, another adapter's).
            self.renewer.drop(request.request_id)
            error = f"request {request.request_id}: {exc}"
            num_tokens = len(request.prompt_token_ids or ())
        count = tokens_to_load(num_tokens, self._groups) - num_computed_tokens
        if self._in_step:  # vLLM's step computes at least its last token (async: vLLM cuts)
            count = min(count, request.num_tokens - 1 - num_computed_tokens)
        if count <= 0:
            return 0, False
        if remote is not None:
            self.tickets.hold(request.request_id, key)
        self._matched[request.request_id] = (num_computed_tokens, remote, error)
        return count, not self._in_step

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> bool:
        """vLLM's ``update_state_after_alloc``: the claimed tokens have blocks. Whether a
        load goes to the worker (loaded once: a failed load is recomputed, not retried)."""
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens == 0:
            self.tickets.leave(request.request_id, spent=False)
            return False
        first_token, remote, error = matched
        starts = load_starts(self._groups, first_token + num_external_tokens, first_token)
        if remote is not None and error is None:
            gap = staging_gap(starts, remote.group_starts or (0,) * len(self._groups))
            error = f"request {request.request_id}: {gap}" if gap else None
        self._pending[request.request_id] = LoadSpec(
            request_id=request.request_id,
            block_ids=tuple(list(ids) for ids in blocks.get_block_ids()),
            first_token=first_token,
            remote=remote,
            error=error,
            holds_until=self.renewer.holds_until(request.request_id),
            starts=starts,
            claimed=first_token + num_external_tokens,
            in_step=self._in_step,
        )
        return True

    def take(self) -> list[LoadSpec]:
        """This step's loads, for the worker; a load in the step is over with the step."""
        loads, self._pending = list(self._pending.values()), {}
        self._loading.update(spec.request_id for spec in loads if not spec.in_step)
        self.received({spec.request_id for spec in loads if spec.in_step})
        return loads

    def received(self, request_ids: set[str]) -> None:
        """Asynchronous loads the worker reported done."""
        self._loading.difference_update(request_ids)
        for rid in request_ids:
            self.renewer.drop(rid)
            self.tickets.leave(rid)

    def finished(self, request_id: str) -> bool:
        """Forgets a finished request; True if its load was still running (the worker
        releases its staging then), else a ticket never read is released now."""
        self._matched.pop(request_id, None)
        self._pending.pop(request_id, None)
        loading = request_id in self._loading
        (self.renewer.drop if loading else self.renewer.release)(request_id)
        self.tickets.leave(request_id)
        return loading

    def close(self) -> None:
        self.renewer.close()
