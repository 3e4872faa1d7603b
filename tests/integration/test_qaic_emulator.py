"""The QAIC decode emulator in-process: slot handling against a fake prefill, over shm and
NIXL. The real vLLM prefill -> emulator runs: tests/live/test_qaic_emulator_harness.py."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from emulator.qaic_emulator import DECOY, Emulator, EmulatorConfig
from testbed import copy_task
from testbed.live_servers import random_model
from testbed.shipped_model import MODEL_DIR, TINY, greedy_answer
from testbed.shm_objects import segments
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.kv.token_copies import copy_layers
from vllm_qaic_connector.layout import KVGeometry, blocks_for_tokens
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.side_channel import SideChannelServer
from vllm_qaic_connector.protocol.ticket import RemotePrefill, prompt_hash, ticket_binding
from vllm_qaic_connector.protocol.wire import (
    PROTOCOL_VERSION,
    HandshakeReply,
    HandshakeRequest,
    Message,
    Ok,
    RankMetadata,
    ReleaseRequest,
    Renewed,
    RenewRequest,
    compat_hash,
    parse_ack,
)
from vllm_qaic_connector.region_headers import HEADER_BYTES, RegionHeaders, new_incarnation
from vllm_qaic_connector.transports import create_transport, staging_name
from vllm_qaic_connector.transports.nixl import NixlTransport

MODEL = str(MODEL_DIR)

L, H, D, EOS = TINY.layers, TINY.kv_heads, TINY.head_size, TINY.eos
CTX = 512


def _leftovers(tag: str) -> list[str]:
    return sorted(segments(f"qaic_kv_{tag}"))


class FakePrefill:
    """A prefill rank: staged KV in its shm segment, a side channel that records releases."""

    def __init__(self, tag: str, transport: str = "shm") -> None:
        self.engine, self.incarnation = f"{tag}pf", new_incarnation()
        name = staging_name(self.engine, 0, self.incarnation)
        self.transport = create_transport(transport, name, 4 << 20, 10.0)
        self._released: list[str] = []
        self.renewed: list[str] = []
        self.headers = RegionHeaders(self.transport.staging)
        self.generation = 1 << 32
        self.server = SideChannelServer("127.0.0.1", 0, self._handle, None)

    def _handle(self, msg: Message) -> Message:
        if isinstance(msg, ReleaseRequest):
            self._released += msg.request_ids
            return Ok()
        if isinstance(msg, RenewRequest):
            self.renewed += msg.request_ids
            return Renewed(msg.request_ids)
        assert isinstance(msg, HandshakeRequest)
        rank = RankMetadata(
            self.engine, 0, 1, "vllm_cpu_vec", 16, 64, H, D, TINY.dtype, L, TINY.name,
            compat_hash(L, H, D), self.transport.endpoint(),
            self.incarnation,
        )  # fmt: skip
        return HandshakeReply(PROTOCOL_VERSION, [rank])

    def released(self, count: int) -> list[str]:
        """The requests freed here, over the side channel or by an acknowledgement riding on
        a NIXL READ (as a connector prefill takes them), once ``count`` came or 5 s passed."""
        deadline = time.monotonic() + 5.0
        while len(self._released) < count and time.monotonic() < deadline:
            for message in self.transport.poll_notifications():
                if (ack := parse_ack(message, None)) is not None:
                    self._released += ack.request_ids
            time.sleep(0.01)
        return self._released

    def stage(
        self, rid: str, ids: list[int], layout: str, block: int, lease_s: float = 60.0,
        at: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        """Stage the prompt's KV (computed by transformers) as the connector's prefill would,
        ``at`` bytes into the staging."""
        model = _model()
        with torch.no_grad():
            cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
        n = len(ids)
        fmt = StagingFormat(layout, KVGeometry(H, D, block, torch.float32), L)
        self.generation += 1
        dst_blocks = list(range(blocks_for_tokens(n, block)))
        end = at + HEADER_BYTES + fmt.request_bytes(n)
        params = RemotePrefill(
            do_remote_prefill=True,
            remote_engine_id=self.engine,
            remote_host="127.0.0.1",
            remote_port=self.server.port,
            remote_request_id=rid,
            num_tokens=n,
            staging_offset=at,
            staged_layout=layout,
            staged_block_size=block,
            incarnation=self.incarnation,
            generation=self.generation,
            prompt_hash=prompt_hash(ids),
            lease_s=lease_s,
            expires_at=time.time() + lease_s,
        )
        with self.headers.writing(at, end, self.generation, ticket_binding(params)) as region:
            region.zero_()
            for layer, dst in zip(cache.layers, fmt.layer_views(region, n), strict=True):
                copy_layers([(layer.keys, layer.values)], [0], [dst], dst_blocks, 0, n)
        return msgspec.to_builtins(params)

    def close(self) -> None:
        self.server.close()
        self.transport.close()


_MODEL: list[Any] = []


def _model() -> Any:
    if not _MODEL:
        from transformers import AutoModelForCausalLM

        _MODEL.append(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval())
    return _MODEL[0]


@pytest.fixture
def tag() -> Iterator[str]:
    tag = f"t{os.getpid()}{uuid.uuid4().hex[:6]}"
    yield tag
    assert _leftovers(tag) == []


def _run(emulator: Emulator, fn: Any) -> Any:
    async def go() -> Any:
        async with TestClient(TestServer(emulator.app())) as client:
            return await fn(client)

    return asyncio.run(go())


async def _post(client: TestClient, prompt: str, params: dict | None) -> tuple[int, dict]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 20, "temperature": 0.0}
    if params is not None:
        body["kv_transfer_params"] = params
    resp = await client.post("/v1/completions", json=body)
    return resp.status, await resp.json()


SENTINEL = 7.25


@pytest.mark.parametrize(
    ("transport", "layout", "block", "prefix", "programs", "dtype"),
    [
        ("shm", "qaic_slot", CTX, None, 1, "float32"),
        ("shm", "qaic_slot", CTX, "P0", 1, "float32"),
        ("shm", "vllm_cpu_vec", 16, None, 1, "float32"),
        ("shm", "vllm_cpu_vec", 16, None, 1, "float16"),
        ("nixl", "qaic_slot", CTX, None, 1, "float32"),
        ("nixl", "qaic_slot", CTX, "P0", 2, "float32"),
        ("nixl", "vllm_cpu_vec", 16, None, 1, "float32"),
        ("nixl", "qaic_slot", CTX, None, 1, "float16"),
    ],
    ids=[
        "shm-slot-native", "shm-slot-native-prefixed", "shm-vllm-cpu-converted",
        "shm-vllm-cpu-converted-to-float16", "nixl-slot-native",
        "nixl-slot-native-prefixed-layer-split", "nixl-vllm-cpu-converted",
        "nixl-slot-converted-to-float16",
    ],
)  # fmt: skip
def test_decodes_from_slot_bytes_like_the_reference(
    tag, transport, layout, block, prefix, programs, dtype
):
    """The float32 prefill's KV into float32 programs, and into float16 ones (converted in
    the copy into the slot; over NIXL from the receive buffer, as a READ cannot convert)."""
    prefill = FakePrefill(tag, transport)
    cfg = EmulatorConfig(
        MODEL, f"{tag}d", slots=2, ctx=CTX, kv_cache_prefix=prefix, transport=transport,
        programs=programs, dtype=dtype,
    )  # fmt: skip
    emu = Emulator(cfg)
    try:
        assert len(emu.manifest.programs) == programs
        decoy = emu.endpoint.target.buffer(0, DECOY)
        decoy.copy_(torch.randn(decoy.shape))
        decoy_before = decoy.clone()
        for k, v in (emu.endpoint.target.kv(i) for i in range(L)):  # slot 1 is never used below
            k[1].fill_(SENTINEL)
            v[1].fill_(SENTINEL)
        handshake = side_channel.call(
            "127.0.0.1", emu.endpoint.server.port, HandshakeRequest(PROTOCOL_VERSION, "x"), None, 5
        )
        assert isinstance(handshake, HandshakeReply)
        assert (handshake.ranks[0].layout_kind, handshake.ranks[0].block_size) == ("qaic_slot", CTX)
        assert handshake.ranks[0].endpoint.kind == transport
        names = [s.name for p in emu.manifest.programs for s in p]
        assert ("past_key.1_P0_RetainedState" in names) == (prefix == "P0")
        tok = emu.tokenizer
        cases = copy_task.heldout_prompts(3)
        # Staging is rewritten per request, so each is staged right before it is sent;
        # sequential on two slots, so slot 0 is freed and reused.
        for i, (prompt, answer) in enumerate(cases):
            params = prefill.stage(f"r{i}", tok.encode(prompt), layout, block)
            status, body = _run(emu, lambda c, p=prompt, s=params: _post(c, p, s))
            assert status == 200, body
            ids = tok.encode(prompt)
            want = greedy_answer(_model(), ids, EOS, zero_kv=False)
            text = body["choices"][0]["text"]
            assert text == " " + tok.decode(want)  # vLLM's detokenization, leading space
            assert copy_task.is_correct(text, answer)
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["usage"]["prompt_tokens"] == len(ids)
        assert prefill.released(3) == ["r0", "r1", "r2"]
        tokens = sum(len(tok.encode(p)) for p, _ in cases)
        c = emu.endpoint.counters
        assert c["loaded_requests"] == 3 and c["loaded_tokens"] == tokens
        item = emu.endpoint.target.dtype.itemsize  # exactly [k, :, 0:n, :] per buffer:
        assert c["dma_bytes"] == tokens * L * 2 * H * D * item
        native = layout == "qaic_slot" and dtype == "float32"
        assert c["bytes_copied"] == (0 if native else c["dma_bytes"])
        direct = transport == "nixl" and native
        # Straight into the slot: one descriptor per (layer, K|V, head) as n < ctx.
        assert c["read_descriptors"] == (3 * L * 2 * H if direct else 0)
        assert emu.endpoint.slots_in_use == 0 and emu.endpoint.slots_in_use_max == 1
        assert torch.equal(decoy, decoy_before)
        for k, v in (emu.endpoint.target.kv(i) for i in range(L)):
            assert bool((k[1] == SENTINEL).all()) and bool((v[1] == SENTINEL).all())
        if isinstance(emu.endpoint.reader, NixlTransport):  # staging, receive arena, 2 per layer
            assert emu.endpoint.reader.registrations == 2 + 2 * L
        # The last request's KV sits in slot 0 exactly as staged (positions [0, n)).
        n = len(tok.encode(cases[2][0]))
        k0 = emu.endpoint.target.kv(0)[0][0, :, :n]
        with torch.no_grad():
            ref = _model()(input_ids=torch.tensor([tok.encode(cases[2][0])])).past_key_values
        assert torch.equal(k0, ref.layers[0].keys[0].to(k0.dtype))
    finally:
        emu.close()
        prefill.close()


def test_continues_from_the_prefills_first_token(tag):
    """The proxy's first token from the prefill: the prompt's ids and that token, the slot
    holding the prompt's KV; the answer is the reference's after its first token."""
    prefill = FakePrefill(tag)
    emu = Emulator(EmulatorConfig(MODEL, f"{tag}d", slots=1, ctx=CTX))
    try:
        prompt, answer = copy_task.heldout_prompts(1)[0]
        ids = emu.tokenizer.encode(prompt)
        want = greedy_answer(_model(), ids, EOS, zero_kv=False)
        params = prefill.stage("r0", ids, "qaic_slot", CTX)
        body = {"model": "m", "prompt": ids + want[:1], "max_tokens": 19, "temperature": 0.0}
        body.update(request_id="p1", kv_transfer_params=params)

        async def post(client: TestClient) -> tuple[int, dict]:
            resp = await client.post("/v1/completions", json=body)
            return resp.status, await resp.json()

        status, out = _run(emu, post)
        assert status == 200, out
        first = " " + emu.tokenizer.decode(want[:1])
        assert first + out["choices"][0]["text"] == " " + emu.tokenizer.decode(want)
        assert copy_task.is_correct(first + out["choices"][0]["text"], answer)
        assert out["id"] == "cmpl-p1" and out["usage"]["prompt_tokens"] == len(ids) + 1
        assert emu.endpoint.counters["loaded_tokens"] == len(ids)  # the staged ones
    finally:
        emu.close()
        prefill.close()


def test_corrupt_zeroes_the_slot_so_answers_fail(tag):
    prefill = FakePrefill(tag)
    emu = Emulator(EmulatorConfig(MODEL, f"{tag}d", slots=1, ctx=CTX, corrupt=True))
    try:
        wrong = 0
        for i, (prompt, answer) in enumerate(copy_task.heldout_prompts(4)):
            params = prefill.stage(f"r{i}", emu.tokenizer.encode(prompt), "qaic_slot", CTX)
            status, body = _run(emu, lambda c, p=prompt, s=params: _post(c, p, s))
            assert status == 200
            wrong += not copy_task.is_correct(body["choices"][0]["text"], answer)
        assert wrong >= 3
    finally:
        emu.close()
        prefill.close()


def test_refusals_free_the_slot_and_the_staging(tag):
    prefill = FakePrefill(tag)
    emu = Emulator(EmulatorConfig(MODEL, f"{tag}d", slots=1, ctx=CTX, slot_wait_s=0.3))
    try:
        prompt = copy_task.heldout_prompts(1)[0][0]
        params = prefill.stage("r0", emu.tokenizer.encode(prompt), "qaic_slot", CTX)

        async def scenario(client: TestClient) -> list[tuple[int, dict]]:
            out = [await _post(client, prompt, None)]  # not a handoff
            out.append(await _post(client, prompt + " f1 f2", params))  # 2 tokens past it
            out.append(await _post(client, prompt.rsplit(" ", 1)[0], params))  # short of it
            lora = {**params, "adapter": "0123456789abcdef"}  # a program runs the base model
            out.append(await _post(client, prompt, lora))
            slot = await emu.endpoint._acquire_slot()  # the only slot is busy
            out.append(await _post(client, prompt, params))
            emu.endpoint._free_slot(slot)
            out.append(await _post(client, prompt, params))
            return out

        (s1, b1), (s2, b2), (s2b, b2b), (s2c, b2c), (s3, b3), (s4, _) = _run(emu, scenario)
        assert s1 == 400 and "do_remote_prefill" in b1["error"]["message"]
        assert s2 == s2b == 400 and "tokens" in b2["error"]["message"] + b2b["error"]["message"]
        assert s2c == 400 and "LoRA adapter 0123456789abcdef" in b2c["error"]["message"]
        assert s3 == 503 and "slots busy" in b3["error"]["message"]
        assert s4 == 200
        assert prefill.released(5) == ["r0"] * 5  # every handed-off request freed its staging
        assert emu.endpoint.slots_in_use == 0 and emu.endpoint.counters["slot_wait_timeouts"] == 1
        assert emu.endpoint.target.allocate_slot() == 0  # nothing leaked
    finally:
        emu.close()
        prefill.close()


def test_a_request_waiting_for_a_slot_keeps_its_lease(tag):
    """Queued behind a busy slot for longer than its lease, a request's lease is renewed
    while it waits, so it is decoded from its KV when the slot comes free, not refused."""
    prefill = FakePrefill(tag)
    emu = Emulator(EmulatorConfig(MODEL, f"{tag}d", slots=1, ctx=CTX))
    try:
        prompt, answer = copy_task.heldout_prompts(1)[0]
        params = prefill.stage("r0", emu.tokenizer.encode(prompt), "qaic_slot", CTX, lease_s=1.0)

        async def scenario(client: TestClient) -> tuple[int, dict]:
            slot = await emu.endpoint._acquire_slot()  # the only slot is busy for 2.5 leases
            waiting = asyncio.ensure_future(_post(client, prompt, params))
            await asyncio.sleep(2.5)
            emu.endpoint._free_slot(slot)
            return await waiting

        status, body = _run(emu, scenario)
        assert status == 200, body
        assert copy_task.is_correct(body["choices"][0]["text"], answer)
        assert prefill.renewed.count("r0") >= 2 and prefill.released(1) == ["r0"]
        assert emu.endpoint.counters["slot_waits"] == 1
    finally:
        emu.close()
        prefill.close()


def test_a_streamed_answer_is_the_whole_one_in_chunks(tag):
    """As llm-d's sidecar asks the decode (streamed, with usage): one chunk a token, their
    texts and token ids the unstreamed answer's, the usage last, then [DONE]."""
    prefill = FakePrefill(tag)
    emu = Emulator(EmulatorConfig(MODEL, f"{tag}d", slots=1, ctx=CTX))
    try:
        prompt, answer = copy_task.heldout_prompts(1)[0]
        ids = emu.tokenizer.encode(prompt)
        body = {"model": "m", "prompt": prompt, "max_tokens": 20, "return_token_ids": True}

        async def scenario(client: TestClient) -> tuple[dict, list[bytes]]:
            params = prefill.stage("whole", ids, "qaic_slot", CTX)
            whole = await client.post(
                "/v1/completions", json={**body, "kv_transfer_params": params}
            )
            params = prefill.stage("streamed", ids, "qaic_slot", CTX)
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            resp = await client.post(
                "/v1/completions", json={**streamed, "kv_transfer_params": params}
            )
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            return await whole.json(), (await resp.read()).split(b"\n\n")

        whole, events = _run(emu, scenario)
        assert events[-2:] == [b"data: [DONE]", b""]
        chunks = [json.loads(e[6:]) for e in events[:-2]]
        choices = [c["choices"][0] for c in chunks[:-1]]
        want = whole["choices"][0]
        assert copy_task.is_correct(want["text"], answer)
        assert "".join(c["text"] for c in choices) == want["text"]
        assert [t for c in choices for t in c["token_ids"]] == want["token_ids"]
        assert all(len(c["token_ids"]) == 1 for c in choices)
        assert [c["finish_reason"] for c in choices][-2:] == [None, "stop"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        assert prefill.released(2) == ["whole", "streamed"]
    finally:
        emu.close()
        prefill.close()


@pytest.mark.parametrize("exec_objects", [1, 2])
def test_an_exec_object_pool_decodes_slots_at_once(tag, exec_objects):
    """Two requests in two slots: with two exec objects their decodes overlap in time, each
    from its own slot's bytes (both answers right); with one they take turns."""
    prefill = FakePrefill(tag)
    emu = Emulator(EmulatorConfig(MODEL, f"{tag}d", slots=2, ctx=CTX, exec_objects=exec_objects))
    spans: list[tuple[float, float]] = []
    decode = emu.device.decode

    def timed(*args: Any) -> Any:
        start = time.monotonic()
        time.sleep(0.3)  # a decode step long enough that two at once must overlap
        out = decode(*args)
        spans.append((start, time.monotonic()))
        return out

    emu.device.decode = timed  # type: ignore[method-assign]
    try:
        pairs = copy_task.heldout_prompts(2)
        params = [prefill.stage(f"r{i}", emu.tokenizer.encode(p), "qaic_slot", CTX, at=i << 21)
                  for i, (p, _) in enumerate(pairs)]  # fmt: skip

        async def scenario(client: TestClient) -> list[tuple[int, dict]]:
            posts = (_post(client, p, kv) for (p, _), kv in zip(pairs, params, strict=True))
            return list(await asyncio.gather(*posts))

        for (status, body), (_, answer) in zip(_run(emu, scenario), pairs, strict=True):
            assert status == 200 and copy_task.is_correct(body["choices"][0]["text"], answer)
        (a0, a1), (b0, b1) = sorted(spans)
        assert (b0 < a1) == (exec_objects == 2), spans
    finally:
        emu.close()
        prefill.close()


@pytest.mark.nixl
def test_failed_nixl_pulls_free_the_slot_and_the_staging_and_leave_nothing_registered(tag):
    """A stale ticket (the region was restaged) and a dead prefill agent: each request gets a
    clean 502, its slot is free again, the prefill is told to release, and the emulator's
    NIXL agent holds exactly the registrations it started with and no remote agent."""
    prefill = FakePrefill(tag, "nixl")
    emu = Emulator(EmulatorConfig(MODEL, f"{tag}d", slots=1, ctx=CTX, transport="nixl"))
    try:
        assert isinstance(emu.endpoint.reader, NixlTransport)
        (p0, _), (p1, _) = copy_task.heldout_prompts(2)
        stale = prefill.stage("r0", emu.tokenizer.encode(p0), "qaic_slot", CTX)
        prefill.stage("r1", emu.tokenizer.encode(p1), "qaic_slot", CTX)  # reuses r0's region
        status, body = _run(emu, lambda c: _post(c, p0, stale))
        assert status == 502 and "reused, released or its lease expired" in body["error"]["message"]
        registered = emu.endpoint.reader.registrations
        live = prefill.stage("r2", emu.tokenizer.encode(p0), "qaic_slot", CTX)
        prefill.transport.close()  # agent and staging gone; the side channel stays up
        status, body = _run(emu, lambda c: _post(c, p0, live))
        assert status == 502 and "KV load failed" in body["error"]["message"]
        assert prefill.released(2) == ["r0", "r2"]
        assert (
            emu.endpoint.counters["load_failures"] == 2
            and emu.endpoint.counters["read_descriptors"] == 0
        )
        assert emu.endpoint.slots_in_use == 0 and emu.endpoint.target.allocate_slot() == 0
        assert emu.endpoint.reader.registrations == registered == 2 + 2 * L
        assert emu.endpoint.reader.remote_agents == []
    finally:
        emu.close()
        prefill.close()
    assert emu.endpoint.reader.registrations == 0


# --- the real thing: vLLM prefill -> emulator ------------------------------------------------


def test_a_model_with_multi_head_latent_attention_is_refused_at_start_up(tmp_path_factory):
    """Its cache is one latent per token, not the per-head K and V a QAIC program's
    retained-state buffers hold: the server does not start, and says why."""
    model = random_model(tmp_path_factory, "deepseek_v2")
    with pytest.raises(ValueError, match=r"multi-head latent attention .*per-head K and V"):
        Emulator(EmulatorConfig(str(model), "mla"))
