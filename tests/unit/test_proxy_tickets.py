"""Tickets stay between the proxy and the engines (`vllm_qaic_proxy.apis`): what is taken out
of a client's body, and of an answer or a stream on its way to the client."""

from __future__ import annotations

import json

from vllm_qaic_proxy import apis

TICKET = {"do_remote_prefill": True, "remote_port": 5601, "block_ids": [3, 4]}


def test_a_client_s_body_loses_every_connector_field_and_keeps_the_rest():
    forged = {"do_remote_decode": True, "keep_turn": True, "turn_id": "x", "earlier_turn": TICKET}
    body = {
        "prompt": "hi",
        "kv_transfer_params": forged,
        "vllm_xargs": {"kv_transfer_params": "x", "mine": 1},
    }
    assert apis.from_client(body) == {"prompt": "hi", "vllm_xargs": {"mine": 1}}
    assert body["kv_transfer_params"] is forged  # the client's, untouched
    assert apis.from_client({"prompt": "hi", "vllm_xargs": {"a": 1}}) == {
        "prompt": "hi", "vllm_xargs": {"a": 1}}  # fmt: skip


def test_a_relayed_json_body_is_stripped_and_any_other_passes_as_it_came():
    escaped = b'{"kv\\u005ftransfer_params": {"do_remote_prefill": true}, "prompt": [1]}'
    assert json.loads(apis.relayed(escaped)) == {"prompt": [1]}
    dup = b'{"kv_transfer_params": null, "token_ids": [1], "kv_transfer_params": {"a": 1}}'
    assert json.loads(apis.relayed(dup)) == {"token_ids": [1]}
    for data in (b"", b"--boundary\r\n\xff\xfe", b'{"prompt": "hi"}', b"[1]", b"[" * 100_000):
        assert apis.relayed(data) == data


def test_an_answer_s_ticket_is_taken_out_at_its_top_and_in_a_responses_event():
    answer = {"choices": [], "kv_transfer_params": dict(TICKET)}
    assert apis.taken(answer) == TICKET and answer["kv_transfer_params"] is None
    event = {"type": "response.completed", "response": {"kv_transfer_params": dict(TICKET)}}
    assert apis.taken(event) == TICKET and event["response"]["kv_transfer_params"] is None
    assert apis.taken({"kv_transfer_params": None}) is None and apis.taken([1]) is None


def test_a_stream_s_events_come_through_whole_without_tickets_whatever_the_chunks():
    ticketed = {"choices": [], "kv_transfer_params": TICKET}
    stream = (
        b'data: {"choices":[{"text":"Hel"}]}\n\n'
        + f"event: response.completed\ndata: {json.dumps(ticketed)}\r\n\r\n".encode()
        + b"data: [DONE]\n\n"
    )
    nulled = {**ticketed, "kv_transfer_params": None}
    expected = stream.replace(json.dumps(ticketed).encode(), json.dumps(nulled).encode())
    for size in (1, 7, len(stream)):
        events = apis.Events()
        out = b"".join(events.feed(stream[i : i + size]) for i in range(0, len(stream), size))
        assert out + events.end() == expected and events.ticket == TICKET
    events = apis.Events()  # a whole JSON answer, relayed: one line, no newline at its end
    whole = json.dumps(ticketed).encode()
    assert json.loads(events.feed(whole) + events.end()) == {**ticketed, "kv_transfer_params": None}
    untouched = b'data: {"kv_transfer_params":null}\n\n'
    assert apis.Events().feed(untouched) == untouched  # no ticket: the bytes as they came
