"""The proxy's kept turns (`vllm_qaic_proxy.turns`): which request continues which
conversation, whose it is, and what is released when."""

from __future__ import annotations

import json
import time

import pytest

from vllm_qaic_proxy import apis, turns
from vllm_qaic_proxy.turns import Turns

ALICE = turns.client({"Authorization": "Bearer alice"}, "10.0.0.1")
BOB = turns.client({"Authorization": "Bearer bob"}, "10.0.0.1")
DECODE_KV = "127.0.0.1:5601"


def ticket(n: int, expires_in: float = 60.0) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_request_id": f"t{n}",
        "expires_at": time.time() + expires_in,
    }


@pytest.fixture
def released() -> list[dict]:
    return []


@pytest.fixture
def kept(released) -> Turns:
    return Turns(released.append)


def test_a_completion_continues_the_longest_prompt_it_begins_with(kept):
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "a b"}, ALICE, ticket(1))
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "a b c d"}, ALICE, ticket(2))
    later = {"model": "m", "prompt": "a b c d e f"}
    assert kept.take(apis.COMPLETIONS, later, ALICE)["remote_request_id"] == "t2"
    assert kept.take(apis.COMPLETIONS, later, ALICE)["remote_request_id"] == "t1"  # t2 taken
    assert kept.take(apis.COMPLETIONS, later, ALICE) is None


@pytest.mark.parametrize(
    "other",
    [
        ({"model": "m", "prompt": "a b c"}, BOB),  # another client's credentials
        ({"model": "n", "prompt": "a b c"}, ALICE),  # another model
        ({"model": "m", "prompt": "a b c", "cache_salt": "s"}, ALICE),  # another salt
        ({"model": "m", "prompt": "a x c"}, ALICE),  # the history edited
        ({"model": "m", "prompt": ["a b c"]}, ALICE),  # a list of prompts
        ({"model": "m", "prompt": "a b c", "n": 2}, ALICE),  # n answers: none prefilled
    ],
    ids=["credentials", "model", "salt", "edited", "list", "n"],
)
def test_a_request_never_takes_what_is_not_its_conversation(kept, other):
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "a b"}, ALICE, ticket(1))
    body, auth = other
    assert kept.take(apis.COMPLETIONS, body, auth) is None
    assert kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "a b c"}, ALICE) is not None


def test_a_chat_continues_by_its_messages_whatever_the_answer_said(kept):
    said = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    kept.keep(apis.CHAT, {"model": "m", "messages": said}, ALICE, ticket(1))
    again = [*said, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert kept.take(apis.CHAT, {"model": "m", "messages": again}, ALICE) is not None
    kept.keep(apis.CHAT, {"model": "m", "messages": said}, ALICE, ticket(2))
    other = [{"role": "system", "content": "be long"}, *said[1:]]
    assert kept.take(apis.CHAT, {"model": "m", "messages": other}, ALICE) is None
    # The prefill checks the answer's tokens: a wrong guess costs a recompute only.
    guess = [*said, {"role": "assistant", "content": "hola"}]
    assert kept.take(apis.CHAT, {"model": "m", "messages": guess}, ALICE) is not None


@pytest.mark.parametrize(
    ("api", "history", "system"),
    [(apis.MESSAGES, "messages", "system"), (apis.RESPONSES, "input", "instructions")],
    ids=["messages", "responses"],
)
def test_messages_and_responses_continue_by_their_history_and_system_prompt(
    kept, api, history, system
):
    said = [{"role": "user", "content": "hi"}]
    first = {"model": "m", system: "be brief", history: said}
    kept.keep(api, first, ALICE, ticket(1))
    again = [*said, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert kept.take(api, {**first, system: "be long", history: again}, ALICE) is None
    assert kept.take(api, {**first, history: again}, ALICE)["remote_request_id"] == "t1"
    # A Responses input of one string continues nothing (no history to begin with).
    assert turns.conversation(api, {"model": "m", history: "hi"}) is None


def test_what_is_no_turn_s_ticket_is_not_kept(kept, released):
    body = {"model": "m", "prompt": "a b"}
    kept.keep(apis.COMPLETIONS, body, ALICE, None)  # the decode kept nothing
    kept.keep(apis.COMPLETIONS, body, ALICE, {"do_remote_prefill": False})
    assert kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "a b c d"}, ALICE) is None
    assert released == []


def test_an_expired_ticket_is_dropped_and_the_oldest_released_past_the_limit(
    kept, released, monkeypatch
):
    monkeypatch.setattr(turns, "MAX_KEPT", 2)
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "x"}, ALICE, ticket(0, -1))
    assert kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "x y z"}, ALICE) is None
    for n in range(1, 4):
        kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": f"p{n}"}, ALICE, ticket(n))
    assert [t["remote_request_id"] for t in released] == ["t1"]  # the decode frees it now


def test_the_same_turn_kept_again_releases_the_ticket_it_replaces(kept, released):
    body = {"model": "m", "prompt": "a b"}
    kept.keep(apis.COMPLETIONS, body, ALICE, ticket(1))
    kept.keep(apis.COMPLETIONS, body, ALICE, ticket(2))
    assert [t["remote_request_id"] for t in released] == ["t1"]
    taken = kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "a b c"}, ALICE)
    assert taken["remote_request_id"] == "t2"


def test_without_reuse_turns_nothing_is_asked_or_kept(released):
    off = Turns(released.append, enabled=False)
    body = {"model": "m", "prompt": "a b"}
    assert off.asked(apis.COMPLETIONS, body, DECODE_KV) is None
    assert off.asked(apis.COMPLETIONS, {**body, "stream": True}, DECODE_KV) is None
    off.keep(apis.COMPLETIONS, body, ALICE, ticket(1))
    assert off.take(apis.COMPLETIONS, {"model": "m", "prompt": "a b c"}, ALICE) is None


def test_a_turn_is_asked_by_a_fresh_name_a_stream_s_where_the_decode_s_side_channel_is_known(
    kept,
):
    body = {"model": "m", "prompt": "a b"}
    names = {kept.asked(apis.COMPLETIONS, body, "") for _ in range(3)}
    assert len(names) == 3 and all(isinstance(n, str) and len(n) == 32 for n in names)
    streamed = {**body, "stream": True}
    assert isinstance(kept.asked(apis.COMPLETIONS, streamed, DECODE_KV), str)
    assert kept.asked(apis.COMPLETIONS, streamed, "") is None  # its ticket could not be had
    assert kept.asked(apis.RESPONSES, {"model": "m", "input": "a b"}, DECODE_KV) is None
    assert kept.asked(apis.COMPLETIONS, {**body, "n": 2}, DECODE_KV) is None  # n turns


def test_a_ticket_for_a_request_no_conversation_continues_is_released_at_once(kept, released):
    kept.keep(apis.RESPONSES, {"model": "m", "input": "a b"}, ALICE, ticket(1))
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "a b", "n": 2}, ALICE, ticket(2))
    assert [t["remote_request_id"] for t in released] == ["t1", "t2"]


def test_anonymous_clients_neither_take_nor_flush_each_other_s_turns(kept, monkeypatch):
    """Without Authorization every client was one owner: any could take another's turn, or
    flush the store. Now an anonymous client is its address."""
    here, there = turns.client({}, "10.0.0.1"), turns.client({}, "10.0.0.2")
    posing = turns.client({"Authorization": json.dumps([None, "10.0.0.1"])}, "10.0.0.3")
    assert len({here, there, posing, ALICE}) == 4
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "a b"}, here, ticket(1))
    later = {"model": "m", "prompt": "a b c"}
    assert kept.take(apis.COMPLETIONS, later, there) is None
    assert kept.take(apis.COMPLETIONS, later, posing) is None
    monkeypatch.setattr(turns, "MAX_KEPT", 4)
    for n in range(10):  # another anonymous client floods the store
        kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": f"p{n}"}, there, ticket(n + 2))
    assert kept.take(apis.COMPLETIONS, later, here)["remote_request_id"] == "t1"


def test_the_store_is_bounded_in_bytes_and_a_flood_drops_the_flooder_s_turns(
    kept, released, monkeypatch
):
    long = "x" * 1000
    monkeypatch.setattr(turns, "MAX_KEPT_BYTES", 4000)
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": long}, ALICE, ticket(1))
    for n in range(2, 10):
        kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": f"{n}{long}"}, BOB, ticket(n))
    assert len(kept) <= 4 and len(released) >= 5  # the bound holds: the oldest are released
    assert {t["remote_request_id"] for t in released} <= {f"t{n}" for n in range(2, 10)}
    assert kept.take(apis.COMPLETIONS, {"model": "m", "prompt": long + "y"}, ALICE) is not None


def test_a_turn_kept_by_a_decode_marked_down_is_dropped_not_taken(released):
    down = {"http://d1"}
    kept = Turns(released.append, down=down.__contains__)
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "a b"}, ALICE, ticket(1), "http://d1")
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "c d"}, ALICE, ticket(2), "http://d2")
    assert kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "a b c"}, ALICE) is None
    assert kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "c d e"}, ALICE) is not None
    assert len(kept) == 0 and released == []  # the dead decode's lease frees it
