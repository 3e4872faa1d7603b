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
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.tokenizers import get_tokenizer
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from vllm_qaic_connector.model_weights import checkpoint_fingerprint, kv_settings
from vllm_qaic_connector.protocol.keys import KEY_ENV, load_key
from vllm_qaic_connector.qaic.decode_endpoint import DecodeEndpoint, EndpointConfig, Refused
from vllm_qaic_connector.qaic.target import BufferSpec, Manifest, SlotTarget, torch_dtype
from vllm_qaic_proxy.server import MAX_REQUEST_BYTES

logger = init_logger(__name__)
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
            name = f"past_{kind}.{i}{'_' + prefix if prefix else ''}_RetainedState"
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
    dtype: str = "float32"  # the compiled program's KV dtype; a float prefill's is converted
    kv_cache_prefix: str | None = None
    corrupt: bool = False  # negative control: zero the slot after binding
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    slot_wait_s: float = 60.0
    transport: str = "shm"  # how the prefill's staged KV reaches the slots: shm or nixl
    programs: int = 1  # >1: the layers split over that many programs
    exec_objects: int = 1  # decodes at once, each on its own slot


class TransformersDevice:
    """The `DecodeDevice` in place of the QAIC runtime: transformers decodes straight from
    the slot buffers, so the same tokens as vLLM prove the slot bytes."""

    def __init__(self, model: Any, corrupt: bool) -> None:
        self.model, self.corrupt = model, corrupt
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

    def bind_slot(self, target: SlotTarget, slot: int, num_tokens: int) -> None:
        if self.corrupt:  # negative control: answers must now go wrong
            for k, v in (target.kv(i) for i in range(target.num_layers)):
                k[slot].zero_()
                v[slot].zero_()

    @torch.no_grad()
    def decode(
        self, target: SlotTarget, slot: int, prompt_ids: list[int], max_tokens: int
    ) -> tuple[list[int], str]:
        """Greedy decode from the slot: KV of positions [0, n-1) as the cache, token n-1
        recomputed (as vLLM's decode and scripts/eval_tiny_model.py do)."""
        n = len(prompt_ids)
        kv = [
            (k[slot : slot + 1, :, : n - 1], v[slot : slot + 1, :, : n - 1])
            for k, v in (target.kv(i) for i in range(target.num_layers))
        ]
        cache = DynamicCache(kv if n > 1 else None, config=self.model.config)  # copies out
        nxt, out = prompt_ids[-1], []
        for _ in range(min(max_tokens, target.ctx_len - n)):
            res = self.model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
            cache, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
            out.append(nxt)
            if nxt in self.eos_ids:
                return out, "stop"
        return out, "length"

    def free_slot(self, target: SlotTarget, slot: int) -> None:
        pass  # the slot's bytes are the programs' KV: nothing to give back


class Emulator:
    """A QAIC decode server: the package's `DecodeEndpoint` on a `TransformersDevice`,
    behind vLLM's completions API."""

    def __init__(self, cfg: EmulatorConfig, key: bytes | None = None) -> None:
        self.cfg = cfg
        if latent := getattr(AutoConfig.from_pretrained(cfg.model), "kv_lora_rank", None):
            raise ValueError(
                f"{cfg.model} uses multi-head latent attention (MLA, a latent of {latent} "
                "values per token): QAIC decode programs hold per-head K and V buffers "
                "(past_key.{i}, past_value.{i}); serve this model's decode with vLLM"
            )
        self.tokenizer = get_tokenizer(cfg.model)  # as vLLM tokenizes prompts
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch_dtype(cfg.dtype))
        self.device = TransformersDevice(model.eval(), cfg.corrupt)
        self.device.eos_ids.add(self.tokenizer.eos_token_id)
        mc = model.config
        heads, layers = mc.num_key_value_heads, mc.num_hidden_layers
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.manifest = build_manifest(
            layers, cfg.slots, heads, cfg.ctx, head_dim, cfg.dtype, cfg.kv_cache_prefix,
            cfg.programs,
        )  # fmt: skip
        endpoint_cfg = EndpointConfig(
            cfg.engine_id, Path(cfg.model).resolve().name,
            checkpoint_fingerprint(Path(cfg.model), kv_settings(None, mc)), cfg.kv_cache_prefix,
            cfg.host, cfg.side_channel_port, cfg.transport, cfg.slot_wait_s, cfg.exec_objects,
        )  # fmt: skip
        self.endpoint = DecodeEndpoint(endpoint_cfg, self.manifest, self.device, key)
        names = [r.spec.name for kv in self.manifest.kv_buffers(cfg.kv_cache_prefix) for r in kv]
        logger.info(
            "QAIC emulator %s: %d slots x %d tokens, %s KV buffers %s, side channel %s:%d",
            *(cfg.engine_id, cfg.slots, cfg.ctx, cfg.dtype, names, cfg.host,
              self.endpoint.server.port),
        )  # fmt: skip

    def _detokenize(self, prompt_ids: list[int], out: list[int]) -> list[str]:
        """The text each token adds. vLLM's own detokenizer, as a vLLM decode writes the
        text: primed with the prompt's end, special tokens skipped, the stop token left out.
        (A DecodeStream of our own failed on a SentencePiece tokenizer's byte pieces, where
        vLLM's restarts.)"""
        params = SamplingParams(max_tokens=max(1, len(out)))
        request = EngineCoreRequest("qaic", prompt_ids, None, params, None, 0.0, None, None, None)
        detokenizer = IncrementalDetokenizer.from_new_request(self.tokenizer, request)
        deltas = []
        for i, t in enumerate(out):
            detokenizer.update([t], stop_terminated=t in self.device.eos_ids)
            deltas.append(detokenizer.get_next_output_text(finished=i == len(out) - 1, delta=True))
        return deltas

    def _prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """One prompt, as text or token ids; greedy."""
        prompt = body.get("prompt")
        if body.get("temperature"):
            raise Refused(400, "want one prompt, temperature 0")
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise Refused(400, "want one prompt: a string or a list of token ids")

    async def _complete(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The answer as vLLM's completions API gives it: one body, or (``stream``) the
        chunks of its event stream, one a token, then the usage if asked for."""
        params = body.get("kv_transfer_params") or {}
        try:
            prompt_ids = self._prompt_ids(body)
        except Refused as refusal:
            await self.endpoint.refuse(params, refusal)
        max_tokens = int(body.get("max_tokens") or 16)
        out, finish = await self.endpoint.decode(params, prompt_ids, max_tokens)
        deltas, n = self._detokenize(prompt_ids, out), len(prompt_ids)
        usage = {"prompt_tokens": n, "completion_tokens": len(out), "total_tokens": n + len(out)}
        ids = bool(body.get("return_token_ids"))  # as vLLM: the stop token is among them
        rid = body.get("request_id") or f"qaic-{time.monotonic_ns()}"
        head = {"id": f"cmpl-{rid}", "object": "text_completion", "model": body.get("model")}
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(deltas), "finish_reason": finish}
            if ids:
                choice.update(prompt_token_ids=prompt_ids, token_ids=out)
            return [{**head, "choices": [choice], "usage": usage}]
        chunks = []
        for i, (token, text) in enumerate(zip(out, deltas, strict=True)):
            last = i == len(out) - 1
            choice = {"index": 0, "text": text, "finish_reason": finish if last else None}
            if ids:
                choice["token_ids"] = [token]
            chunks.append({**head, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": usage})
        return chunks

    # --- HTTP -----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except ValueError:
                body = None
            if not isinstance(body, dict):
                raise Refused(400, "the body must be a JSON object")
            # Shielded: a client that goes away must not free a slot a thread still writes.
            chunks = await asyncio.shield(self._complete(body))
        except Refused as exc:
            logger.warning("request refused (%d): %s", exc.status, exc)
            err = {"message": str(exc), "type": "QAICEmulatorError", "code": exc.status}
            return web.json_response({"error": err}, status=exc.status)
        if not body.get("stream"):
            return web.json_response(chunks[0])
        # Sent once the decode is done: the emulator decodes a request whole.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def metrics(self, _: web.Request) -> web.Response:
        rows = self.endpoint.metrics()
        rows.append(("vllm:prefix_cache_hits_total", "counter", 0))  # the verdict reads it
        text = "".join(f"# TYPE {name} {kind}\n{name} {value}\n" for name, kind, value in rows)
        return web.Response(text=text, content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)  # as vLLM and the proxy
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    def close(self) -> None:
        self.endpoint.close()


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
    add("--dtype", default="float32", help="KV dtype of the program (a float prefill's converts)")
    add("--kv-cache-prefix", default=None, help="QEfficient kv_cache_prefix of the KV buffers")
    add("--slot-wait-s", type=float, default=60.0, help="longest wait for a free slot")
    add("--corrupt", action="store_true", help="negative control: zero the slot KV")
    add("--transport", choices=["shm", "nixl"], default="shm", help="how staged KV arrives")
    add("--programs", type=int, default=1, help="split the layers over this many programs")
    add("--exec-objects", type=int, default=1, help="decodes at once, each on its own slot")
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
