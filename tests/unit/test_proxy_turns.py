"""The proxy's kept turns (`vllm_qaic_proxy.turns`): which request continues which
conversation, whose it is, and what is released when."""

from __future__ import annotations

import time

import pytest

from vllm_qaic_proxy import apis, turns
from vllm_qaic_proxy.turns import Turns

ALICE, BOB = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}


def ticket(n: int, expires_in: float = 60.0) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_request_id": f"t{n}",
        "expires_at": time.time() + expires_in,
    }


def completion(text: str, params: dict | None = None) -> dict:
    return {"choices": [{"text": text}], "kv_transfer_params": params}


def chat_answer(text: str, params: dict | None = None) -> dict:
    message = {"role": "assistant", "content": text, "tool_calls": []}
    return {"choices": [{"message": message}], "kv_transfer_params": params}


@pytest.fixture
def released() -> list[dict]:
    return []


@pytest.fixture
def kept(released) -> Turns:
    return Turns(released.append)


def test_a_completion_continues_the_longest_conversation_it_begins_with(kept):
    body = {"model": "m", "prompt": "a b"}
    kept.keep(apis.COMPLETIONS, body, ALICE, completion(" c", ticket(1)))
    kept.keep(
        apis.COMPLETIONS, {"model": "m", "prompt": "a b c d"}, ALICE, completion(" e", ticket(2))
    )
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
    ],
    ids=["credentials", "model", "salt", "edited", "list"],
)
def test_a_request_never_takes_what_is_not_its_conversation(kept, other):
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "a b"}, ALICE, completion(" c", ticket(1)))
    body, auth = other
    assert kept.take(apis.COMPLETIONS, body, auth) is None
    assert kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "a b c"}, ALICE) is not None


def test_a_chat_continues_by_messages_whatever_else_the_answer_carried(kept):
    said = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    kept.keep(apis.CHAT, {"model": "m", "messages": said}, ALICE, chat_answer("hello", ticket(1)))
    again = [*said, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert kept.take(apis.CHAT, {"model": "m", "messages": again}, ALICE) is not None
    kept.keep(apis.CHAT, {"model": "m", "messages": said}, ALICE, chat_answer("hello", ticket(2)))
    other = [*said, {"role": "assistant", "content": "hell"}, {"role": "user", "content": "o"}]
    assert kept.take(apis.CHAT, {"model": "m", "messages": other}, ALICE) is None


def test_answers_without_a_turn_s_ticket_are_not_kept(kept):
    body = {"model": "m", "prompt": "a b"}
    kept.keep(apis.COMPLETIONS, body, ALICE, completion(" c"))  # the decode kept nothing
    kept.keep(apis.COMPLETIONS, body, ALICE, completion(" c", {"do_remote_prefill": False}))
    kept.keep(apis.RESPONSES, {"model": "m", "input": "a b"}, ALICE, completion(" c", ticket(1)))
    assert kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "a b c d"}, ALICE) is None


def test_an_expired_ticket_is_dropped_and_the_oldest_released_past_the_limit(
    kept, released, monkeypatch
):
    monkeypatch.setattr(turns, "MAX_KEPT", 2)
    kept.keep(
        apis.COMPLETIONS, {"model": "m", "prompt": "x"}, ALICE, completion(" y", ticket(0, -1))
    )
    assert kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "x y z"}, ALICE) is None
    for n in range(1, 4):
        kept.keep(
            apis.COMPLETIONS, {"model": "m", "prompt": f"p{n}"}, ALICE, completion(" a", ticket(n))
        )
    assert [t["remote_request_id"] for t in released] == ["t1"]  # the decode frees it now


def test_the_same_turn_kept_again_releases_the_ticket_it_replaces(kept, released):
    body = {"model": "m", "prompt": "a b"}
    kept.keep(apis.COMPLETIONS, body, ALICE, completion(" c", ticket(1)))
    kept.keep(apis.COMPLETIONS, body, ALICE, completion(" c", ticket(2)))
    assert [t["remote_request_id"] for t in released] == ["t1"]
    assert (
        kept.take(apis.COMPLETIONS, {"model": "m", "prompt": "a b c"}, ALICE)["remote_request_id"]
        == "t2"
    )


def test_without_reuse_turns_nothing_is_asked_or_kept(released):
    off = Turns(released.append, enabled=False)
    body = {"model": "m", "prompt": "a b"}
    assert not off.wanted(apis.COMPLETIONS, body)
    assert not off.wanted(apis.COMPLETIONS, {**body, "stream": True})  # (on, too: no ticket)
    off.keep(apis.COMPLETIONS, body, ALICE, completion(" c", ticket(1)))
    assert off.take(apis.COMPLETIONS, {"model": "m", "prompt": "a b c"}, ALICE) is None


def test_a_whole_answer_s_turn_is_asked_a_stream_s_is_not(kept):
    body = {"model": "m", "prompt": "a b"}
    assert kept.wanted(apis.COMPLETIONS, body)
    assert not kept.wanted(apis.COMPLETIONS, {**body, "stream": True})
    assert not kept.wanted(apis.RESPONSES, {"model": "m", "input": "a b"})
    assert not kept.wanted(apis.COMPLETIONS, {**body, "n": 2})  # n turns, no one to continue


def test_a_ticket_for_an_answer_no_conversation_continues_is_released_at_once(kept, released):
    two = {"choices": [{"text": " c"}, {"text": " d"}], "kv_transfer_params": ticket(1)}
    kept.keep(apis.COMPLETIONS, {"model": "m", "prompt": "a b", "n": 2}, ALICE, two)
    assert [t["remote_request_id"] for t in released] == ["t1"]
