"""A stand-in for the QAIC decode engine: it takes prompt KV from a real vLLM prefill through
the connector protocol, binds it into a batch slot of named host buffers, and decodes from
those slot bytes with transformers. Same tokens as vLLM means the slot bytes are right.

    python -m emulator.qaic_emulator --model DIR --port 8200 --side-channel-port 5600 \\
        --slots 32 --ctx 1024 --engine-id emu [--kv-cache-prefix P] [--transport nixl] \\
        [--programs 2]

Over shm the device DMAs from the prefill's staging; over NIXL the slot buffers are registered
with a NIXL agent and the READ lands straight in slot k (qaic.slot_pull).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from aiohttp import web
from transformers import AutoModelForCausalLM, DynamicCache
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.tokenizers import get_tokenizer
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.layout import KVGeometry, blocks_for_tokens
from vllm_qaic_connector.model_weights import checkpoint_fingerprint, kv_settings
from vllm_qaic_connector.protocol import side_channel
from vllm_qaic_connector.protocol.keys import KEY_ENV, load_key
from vllm_qaic_connector.protocol.peers import PeerDirectory
from vllm_qaic_connector.protocol.side_channel import SideChannelServer
from vllm_qaic_connector.protocol.wire import (
    PROTOCOL_VERSION,
    ErrorReply,
    HandshakeReply,
    HandshakeRequest,
    Message,
    Ok,
    RankMetadata,
    ReleaseRequest,
    RemotePrefill,
    compat_hash,
    parse_remote_prefill,
    ticket_problem,
)
from vllm_qaic_connector.qaic.buffers import apply_prefix
from vllm_qaic_connector.qaic.slot_pull import SlotPuller
from vllm_qaic_connector.qaic.target import BufferSpec, Manifest, SlotTarget, torch_dtype
from vllm_qaic_connector.tickets import checked_read, new_incarnation
from vllm_qaic_connector.transports import create_transport, staging_name
from vllm_qaic_connector.transports.nixl import NixlTransport
from vllm_qaic_proxy.server import MAX_REQUEST_BYTES

logger = init_logger(__name__)
T = TypeVar("T")
# Exported as vllm:qaic_kv_<name>_total. bytes_copied: host copies only; dma_bytes: slot writes.
COUNTERS: tuple[str, ...] = ("loaded_requests", "loaded_tokens", "load_failures", "bytes_copied")
COUNTERS += ("dma_bytes", "slot_waits", "slot_wait_timeouts", "read_descriptors")
DECOY = "vision_embeds_RetainedState"  # a non-KV retained buffer that must stay untouched


def build_manifest(
    layers: int,
    slots: int,
    heads: int,
    ctx: int,
    head_dim: int,
    dtype: str,
    prefix: str | None,
    programs: int = 1,
) -> Manifest:
    """The buffers compiled decode QPCs expose: retained K/V per layer, plus a decoy. With
    ``programs`` > 1 the layers are split in order over that many programs (layer split)."""
    shape = (slots, heads, ctx, head_dim)
    if not 1 <= programs <= layers:
        raise ValueError(f"cannot split {layers} layers over {programs} programs")
    split: list[list[BufferSpec]] = [[] for _ in range(programs)]
    for i in range(layers):
        for kind in ("key", "value"):
            name = apply_prefix(f"past_{kind}.{i}_RetainedState", prefix)
            split[i * programs // layers].append(BufferSpec(name, shape, dtype))
    split[0].append(BufferSpec(DECOY, (slots, 16, head_dim), dtype))
    return Manifest(split)


@dataclass(frozen=True)
class EmulatorConfig:
    """One field per CLI flag (``--engine-id`` -> ``engine_id``)."""

    model: str
    engine_id: str  # also names the shm segments: qaic_kv_<engine_id>_*
    slots: int = 32
    ctx: int = 1024  # tokens per slot; the prefill stages exactly one slot per request
    dtype: str = "float32"  # the compiled program's KV dtype; the prefill must match it
    kv_cache_prefix: str | None = None
    corrupt: bool = False  # negative control: zero the slot after binding
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    slot_wait_s: float = 60.0
    transport: str = "shm"  # how the prefill's staged KV reaches the slots: shm or nixl
    programs: int = 1  # >1: the layers split over that many programs


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Emulator:
    def __init__(self, cfg: EmulatorConfig, key: bytes | None = None) -> None:
        self.cfg, self.key = cfg, key
        dtype = torch_dtype(cfg.dtype)
        self.tokenizer = get_tokenizer(cfg.model)  # as vLLM tokenizes prompts
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).eval()
        mc = self.model.config
        heads, layers = mc.num_key_value_heads, mc.num_hidden_layers
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = {*(eos if isinstance(eos, list) else [eos]), self.tokenizer.eos_token_id}
        self.manifest = build_manifest(
            layers, cfg.slots, heads, cfg.ctx, head_dim, cfg.dtype, cfg.kv_cache_prefix,
            cfg.programs,
        )  # fmt: skip
        self.target = SlotTarget(self.manifest, f"qaic_kv_{cfg.engine_id}", cfg.kv_cache_prefix)
        incarnation = new_incarnation()
        self.puller: SlotPuller | None = None
        name = staging_name(cfg.engine_id, 0, incarnation)
        try:  # nobody reads our staging; the transport is here for its reads of the prefill's
            self.reader = create_transport(cfg.transport, name, 4096, 10.0)
            if isinstance(self.reader, NixlTransport):
                self.puller = SlotPuller(self.target, self.reader)
            self.server = SideChannelServer(cfg.host, cfg.side_channel_port, self._handle, key)
        except BaseException:
            self._close_io()
            raise
        model = Path(cfg.model).resolve().name
        self.rank = RankMetadata(
            engine_id=cfg.engine_id,
            tp_rank=0,
            tp_size=1,
            layout_kind="qaic_slot",
            block_size=cfg.ctx,  # one slot = one block: the prefill stages exactly a slot
            num_blocks=cfg.slots,
            num_kv_heads=heads,
            head_size=head_dim,
            dtype=cfg.dtype,
            num_layers=layers,
            model=model,
            compat_hash=compat_hash(cfg.dtype, layers, heads, head_dim),
            endpoint=self.reader.endpoint(),  # over NIXL: the agent holding the slot buffers
            incarnation=incarnation,
            weights=checkpoint_fingerprint(Path(cfg.model), kv_settings(None, mc)),
        )
        self.peers = PeerDirectory(cfg.engine_id, key, timeout_s=10.0)
        self.peers.ours = self.rank  # refuse prefills whose KV we cannot use
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.slots_in_use = self.slots_in_use_max = 0
        self._slot_sem = asyncio.Semaphore(cfg.slots)
        # Bind (handshake, read, slot write, release) and decode each run on their own thread:
        # one at a time each, so the event loop never blocks and ShmTransport is single-user.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="qaic-emu-bind")
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="qaic-emu-decode")
        names = [r.spec.name for kv in self.manifest.kv_buffers(cfg.kv_cache_prefix) for r in kv]
        logger.info(
            "QAIC emulator %s: %d slots x %d tokens, %s KV buffers %s, side channel %s:%d",
            *(cfg.engine_id, cfg.slots, cfg.ctx, cfg.dtype, names, cfg.host, self.server.port),
        )

    # --- side channel -------------------------------------------------------------------

    def _handle(self, msg: Message) -> Message:
        if isinstance(msg, HandshakeRequest):
            if msg.version != PROTOCOL_VERSION:
                return ErrorReply(f"protocol version {msg.version}, we speak {PROTOCOL_VERSION}")
            return HandshakeReply(PROTOCOL_VERSION, [self.rank])
        if isinstance(msg, ReleaseRequest):
            return Ok()  # we never stage anything for others
        return ErrorReply(f"unexpected message {type(msg).__name__}")

    # --- one request ----------------------------------------------------------------------

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _acquire_slot(self) -> int:
        if self._slot_sem.locked():
            self.counters["slot_waits"] += 1
        try:
            await asyncio.wait_for(self._slot_sem.acquire(), self.cfg.slot_wait_s)
        except asyncio.TimeoutError:
            self.counters["slot_wait_timeouts"] += 1
            raise RequestError(
                503, f"all {self.cfg.slots} decode slots busy for {self.cfg.slot_wait_s}s"
            ) from None
        slot = self.target.allocate_slot()  # cannot fail: the semaphore counts free slots
        self.slots_in_use += 1
        self.slots_in_use_max = max(self.slots_in_use_max, self.slots_in_use)
        return slot

    def _free_slot(self, slot: int) -> None:
        self.target.release_slot(slot)
        self.slots_in_use -= 1
        self._slot_sem.release()

    def _bind(self, slot: int, remote: RemotePrefill) -> tuple[int, int]:
        """Write the staged prompt KV into slot ``slot``; returns (host bytes, DMA bytes)."""
        n = remote.num_tokens
        if n > self.target.ctx_len:
            raise ValueError(f"{n} prompt tokens do not fit a slot of {self.target.ctx_len}")
        ranks = self.peers.get(remote.remote_host, remote.remote_port)
        src = ranks[0]
        if src.incarnation != remote.incarnation:  # the prefill restarted: meet it again
            self.peers.forget(remote.remote_host, remote.remote_port)
            src = self.peers.get(remote.remote_host, remote.remote_port)[0]
        if src.engine_id != remote.remote_engine_id or len(ranks) != 1:
            raise ConnectionError(f"peer is {src.engine_id!r} with TP {len(ranks)}, want TP 1")
        if src.incarnation != remote.incarnation:
            raise ConnectionError(f"engine {src.engine_id} restarted since it staged the KV")
        geo = KVGeometry(
            src.num_kv_heads, src.head_size, remote.staged_block_size, torch_dtype(src.dtype)
        )
        fmt = StagingFormat(remote.staged_layout, geo, src.num_layers)
        if remote.staged_layout == "qaic_slot" and self.puller and self.puller.accepts(geo):
            runs = self.puller.pull(
                slot, src.endpoint, remote.staging_offset, geo, n, remote.generation
            )
            self.counters["read_descriptors"] += len(runs)
            return 0, sum(r.nbytes for r in runs)  # the READ is the DMA: no host copy
        blocks = list(range(blocks_for_tokens(n, remote.staged_block_size)))
        nbytes, generation = fmt.request_bytes(n), remote.generation
        with checked_read(
            self.reader, src.endpoint, remote.staging_offset, nbytes, generation
        ) as region:
            written = self.target.write_slot_from_blocks(
                slot, fmt.layer_views(region, n), blocks, n
            )
        # Staged as our slot: the device DMAs [slot, :, 0:n, :] straight from the staging
        # bytes (setDataWithSlices), no host copy. Otherwise the host converts first.
        native = remote.staged_layout == "qaic_slot" and geo.block_size == self.target.ctx_len
        return (0 if native else written), written

    def _release_remote(self, remote: RemotePrefill) -> None:
        msg = ReleaseRequest([remote.remote_request_id])
        try:
            side_channel.call(remote.remote_host, remote.remote_port, msg, self.key, 10.0)
        except ConnectionError as exc:
            logger.warning("could not release %s (lease will expire): %s", remote, exc)

    @torch.no_grad()
    def _decode(self, slot: int, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        """Greedy decode from the slot: KV of positions [0, n-1) as the cache, token n-1
        recomputed (as vLLM's decode and scripts/eval_tiny_model.py do)."""
        n = len(prompt_ids)
        kv = [
            (k[slot : slot + 1, :, : n - 1], v[slot : slot + 1, :, : n - 1])
            for k, v in (self.target.kv(i) for i in range(self.target.num_layers))
        ]
        cache = DynamicCache(kv if n > 1 else None, config=self.model.config)  # copies out
        nxt, out = prompt_ids[-1], []
        for _ in range(min(max_tokens, self.target.ctx_len - n)):
            res = self.model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
            out.append(nxt)
            if nxt in self.eos_ids:
                return out, "stop"
        return out, "length"

    def _detokenize(self, prompt_ids: list[int], out: list[int]) -> str:
        # vLLM's own detokenizer, as a vLLM decode writes the text: primed with the
        # prompt's end, special tokens skipped, the stop token left out. (A DecodeStream of
        # our own failed on a SentencePiece tokenizer's byte pieces, where vLLM's restarts.)
        params = SamplingParams(max_tokens=max(1, len(out)))
        request = EngineCoreRequest("qaic", prompt_ids, None, params, None, 0.0, None, None, None)
        detokenizer = IncrementalDetokenizer.from_new_request(self.tokenizer, request)
        for t in out:
            detokenizer.update([t], stop_terminated=t in self.eos_ids)
        return detokenizer.get_next_output_text(finished=True, delta=False)

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """One prompt, as text or token ids; greedy, not streamed."""
        prompt = body.get("prompt")
        if body.get("stream") or body.get("temperature"):
            raise RequestError(400, "want one prompt, temperature 0, no streaming")
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise RequestError(400, "want one prompt: a string or a list of token ids")

    async def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        params = body.get("kv_transfer_params") or {}
        if isinstance(params, dict) and params.get("error"):  # a decode program cannot prefill
            raise RequestError(503, f"the prefill could not hand the KV off: {params['error']}")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise RequestError(
                400,
                "the QAIC emulator only decodes handed-off requests: kv_transfer_params "
                "with do_remote_prefill (send the request through the proxy)",
            )
        try:
            remote = parse_remote_prefill(params)
        except ValueError as exc:
            raise RequestError(400, str(exc)) from None
        if unusable := ticket_problem(remote, self.key):  # unsigned: never contacted
            raise RequestError(403, unusable)
        slot: int | None = None
        released = False
        try:
            prompt_ids = self._prompt_ids(body)
            # A program runs the base model ("": no LoRA adapter). The prompt is the staged
            # one, or (the proxy's first token from the prefill) it and one more token.
            if unusable := ticket_problem(remote, None, prompt=prompt_ids, adapter=""):
                raise RequestError(400, unusable)
            if len(prompt_ids) > remote.num_tokens + 1:
                raise RequestError(
                    400, f"prompt is {len(prompt_ids)} tokens, staged KV {remote.num_tokens}"
                )
            slot = await self._acquire_slot()
            try:
                host, dma = await self._run(self._io, self._bind, slot, remote)
            except (ConnectionError, ValueError) as exc:
                self.counters["load_failures"] += 1
                raise RequestError(502, f"KV load failed: {exc}") from None
            finally:
                released = True
                await self._run(self._io, self._release_remote, remote)
            self.counters["loaded_requests"] += 1
            self.counters["loaded_tokens"] += remote.num_tokens
            self.counters["bytes_copied"] += host
            self.counters["dma_bytes"] += dma
            if self.cfg.corrupt:  # negative control: answers must now go wrong
                for k, v in (self.target.kv(i) for i in range(self.target.num_layers)):
                    k[slot].zero_()
                    v[slot].zero_()
            max_tokens = int(body.get("max_tokens") or 16)
            out, finish = await self._run(self._compute, self._decode, slot, prompt_ids, max_tokens)
        finally:
            if not released:  # refused before binding: still free the prefill's staging
                await self._run(self._io, self._release_remote, remote)
            if slot is not None:
                self._free_slot(slot)
        text, n = self._detokenize(prompt_ids, out), len(prompt_ids)
        usage = {"prompt_tokens": n, "completion_tokens": len(out), "total_tokens": n + len(out)}
        choice = {"index": 0, "text": text, "finish_reason": finish}
        if body.get("return_token_ids"):  # as vLLM: the stop token is among them
            choice.update(prompt_token_ids=prompt_ids, token_ids=out)
        rid = body.get("request_id") or f"qaic-{time.monotonic_ns()}"
        return {"id": f"cmpl-{rid}", "object": "text_completion",
                "model": body.get("model"), "choices": [choice], "usage": usage}  # fmt: skip

    # --- HTTP -----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.Response:
        try:
            try:
                body = await request.json()
            except ValueError:
                body = None
            if not isinstance(body, dict):
                raise RequestError(400, "the body must be a JSON object")
            # Shielded: a client that goes away must not free a slot a thread still writes.
            return web.json_response(await asyncio.shield(self._complete(body)))
        except RequestError as exc:
            logger.warning("request refused (%d): %s", exc.status, exc)
            err = {"message": str(exc), "type": "QAICEmulatorError", "code": exc.status}
            return web.json_response({"error": err}, status=exc.status)

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def metrics(self, _: web.Request) -> web.Response:
        rows = [(f"vllm:qaic_kv_{k}_total", "counter", v) for k, v in self.counters.items()]
        rows += [
            ("vllm:prefix_cache_hits_total", "counter", 0),  # the verdict reads it
            ("vllm:qaic_slots_total", "gauge", self.cfg.slots),
            ("vllm:qaic_slots_in_use", "gauge", self.slots_in_use),
            ("vllm:qaic_slots_in_use_max", "gauge", self.slots_in_use_max),
        ]
        text = "".join(f"# TYPE {name} {kind}\n{name} {value}\n" for name, kind, value in rows)
        return web.Response(text=text, content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)  # as vLLM and the proxy
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    def close(self) -> None:
        self.server.close()
        self._io.shutdown(wait=True, cancel_futures=True)
        self._compute.shutdown(wait=True, cancel_futures=True)
        self._close_io()

    def _close_io(self) -> None:
        """Deregister the slot buffers before the agent goes, unlink the slots last."""
        if self.puller is not None:
            self.puller.close()
        if hasattr(self, "reader"):
            self.reader.close()
        self.target.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--model", required=True, help="local HF model directory (its basename is the model)")
    add("--engine-id", required=True, help="engine id; also names the shm segments")
    add("--port", type=int, default=8200, help="HTTP port")
    add("--host", default="127.0.0.1")
    add("--side-channel-port", type=int, default=0)
    add("--slots", type=int, default=32, help="decode batch slots")
    add("--ctx", type=int, default=1024, help="tokens per slot")
    add("--dtype", default="float32", help="KV dtype of the program (the prefill must match)")
    add("--kv-cache-prefix", default=None, help="QEfficient kv_cache_prefix of the KV buffers")
    add("--slot-wait-s", type=float, default=60.0, help="longest wait for a free slot")
    add("--corrupt", action="store_true", help="negative control: zero the slot KV")
    add("--transport", choices=["shm", "nixl"], default="shm", help="how staged KV arrives")
    add("--programs", type=int, default=1, help="split the layers over this many programs")
    add("--side-channel-key-file", default=None, help=f"shared key (else ${KEY_ENV})")
    args = vars(parser.parse_args())
    port = args.pop("port")
    # vLLM configures only its own "vllm" loggers; ours would drop INFO without this.
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    torch.set_num_threads(1)
    key = load_key(args.pop("side_channel_key_file"))
    emulator = Emulator(EmulatorConfig(**args), key)
    try:  # run_app turns SIGTERM/SIGINT into a normal return
        web.run_app(emulator.app(), host=emulator.cfg.host, port=port, print=None)
    finally:
        emulator.close()


if __name__ == "__main__":
    main()
