"""The NIXL -> QAIC slot handoff between two processes, for
tests/integration/test_qaic_slot_veth.py.

``prefill --tag T``: a NixlTransport whose staging holds the KV of ``--prompts`` held-out copy
prompts (computed by transformers on models/tiny-copy), each staged in ``qaic_slot`` layout
(block size = ``--ctx``) at its own offset with its own header generation. Prints
``STAGED <json>``: ``endpoint`` (msgpack hex) and ``staged``, per prompt
``[offset, num_tokens, generation]``. Then waits for ``CLOSE`` (or EOF) on stdin, closes and
prints ``CLOSED <registrations> <remote agents>``.

``decode '<STAGED json>' --tag T``: a SlotTarget (``kv_cache_prefix``, layers split over two
programs), a NixlTransport and a SlotPuller. Fills every slot with a sentinel, pulls each
prompt into its own slot, decodes greedily from the slot bytes and compares with the answer
and with ``greedy_answer``; checks that untouched slots (and positions past each prompt) still
hold the sentinel, and that a pull with a wrong generation raises StaleTicket without
registering anything. Prints ``RESULT <json>``; exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from emulator.qaic_emulator import build_manifest
from testbed import copy_task
from testbed.nixl_peer import decode as decode_endpoint
from testbed.nixl_peer import encode as encode_endpoint
from testbed.shipped_model import MODEL_DIR, TINY, greedy_answer
from vllm_qaic_connector.kv.staging_format import StagingFormat
from vllm_qaic_connector.kv.token_copies import copy_layers
from vllm_qaic_connector.layout import KVGeometry
from vllm_qaic_connector.qaic.slot_pull import SlotPuller
from vllm_qaic_connector.qaic.target import SlotTarget
from vllm_qaic_connector.region_headers import (
    HEADER_BYTES,
    RegionHeaders,
    StaleTicket,
    generations,
    new_incarnation,
)
from vllm_qaic_connector.transports import staging_name
from vllm_qaic_connector.transports.nixl import NixlTransport

MODEL = str(MODEL_DIR)
L, H, D, EOS = TINY.layers, TINY.kv_heads, TINY.head_size, TINY.eos
CTX = 512  # tokens per slot; held-out prompts are 100-400 tokens
STRIDE = 1 << 20  # staging bytes per prompt (64 + 2 * L * H * CTX * D * 4 = 512 KiB + 64)
SLOTS = 6  # one per prompt, one for the stale pull, the rest never touched
SENTINEL = 7.25
PREFIX = "P0"


def geometry(ctx: int) -> KVGeometry:
    return KVGeometry(H, D, ctx, torch.float32)


def load() -> tuple[Any, Any]:
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(MODEL)
    return tok, AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


@torch.no_grad()
def prefill(tag: str, prompts: int, ctx: int) -> int:
    tok, model = load()
    fmt = StagingFormat("qaic_slot", geometry(ctx), L)
    transport = NixlTransport(staging_name(f"{tag}pf", 0, new_incarnation()), prompts * STRIDE)
    headers, generation_ids = RegionHeaders(transport.staging), generations()
    staged: list[list[int]] = []
    for i, (prompt, _) in enumerate(copy_task.heldout_prompts(prompts)):
        ids = tok.encode(prompt)
        n, offset, generation = len(ids), i * STRIDE, next(generation_ids)
        assert HEADER_BYTES + fmt.request_bytes(n) <= STRIDE
        cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
        with headers.writing(offset, offset + HEADER_BYTES + fmt.request_bytes(n), generation) as r:
            r.zero_()
            for layer, dst in zip(cache.layers, fmt.layer_views(r, n), strict=True):
                copy_layers([(layer.keys, layer.values)], [0], [dst], [0], 0, n)
        staged.append([offset, n, generation])
    out = {"endpoint": encode_endpoint(transport.endpoint()), "staged": staged}
    print("STAGED", json.dumps(out), flush=True)
    for line in sys.stdin:
        if line.strip() == "CLOSE":
            break
    transport.close()
    print("CLOSED", transport.registrations, len(transport.remote_agents), flush=True)
    return 0


@torch.no_grad()
def greedy_from_slot(model: Any, target: SlotTarget, slot: int, ids: list[int]) -> list[int]:
    """The emulator's ``_decode``: KV of positions [0, n-1) read from the slot as the cache,
    the last prompt token recomputed; stops at eos (left out, as ``greedy_answer`` does)."""
    n = len(ids)
    kv = [(k[slot : slot + 1, :, : n - 1], v[slot : slot + 1, :, : n - 1])
          for k, v in (target.kv(i) for i in range(target.num_layers))]  # fmt: skip
    cache = DynamicCache(kv, config=model.config)  # copies out of the slot
    nxt, out = ids[-1], []
    for _ in range(copy_task.answer_max_tokens()):
        res = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        cache, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
        if nxt == EOS:
            break
        out.append(nxt)
    return out


def holds_sentinel(target: SlotTarget, slot: int, start: int = 0) -> bool:
    return all(
        bool((buf[slot, :, start:] == SENTINEL).all())
        for layer in range(target.num_layers)
        for buf in target.kv(layer)
    )


def decode(tag: str, staged_json: str, ctx: int) -> int:
    tok, model = load()
    info = json.loads(staged_json)
    peer, staged = decode_endpoint(info["endpoint"]), info["staged"]
    geo = geometry(ctx)
    manifest = build_manifest(L, SLOTS, H, ctx, D, "float32", PREFIX, programs=2)
    target = SlotTarget(manifest, f"qaic_kv_{tag}d", PREFIX)
    transport = NixlTransport(staging_name(f"{tag}d", 0, new_incarnation()), 4096, timeout_s=30)
    puller = SlotPuller(target, transport)
    result: dict[str, Any] = {"prompts": [], "bytes": 0}
    try:
        for layer in range(target.num_layers):
            for buf in target.kv(layer):
                buf.fill_(SENTINEL)
        cases = copy_task.heldout_prompts(len(staged))
        for (prompt, answer), (offset, n, generation) in zip(cases, staged, strict=True):
            ids = tok.encode(prompt)
            slot = target.allocate_slot()
            runs = puller.pull(slot, peer, offset, geo, n, generation)
            result["bytes"] += sum(r.nbytes for r in runs)
            got = greedy_from_slot(model, target, slot, ids)
            want = greedy_answer(model, ids, EOS, zero_kv=False)
            text = tok.decode(got)
            result["prompts"].append({
                "slot": slot, "tokens": n, "descriptors": len(runs), "text": text,
                "answer": answer, "correct": copy_task.is_correct(text, answer),
                "same_as_reference": got == want and n == len(ids),
                "tail_sentinel": holds_sentinel(target, slot, n),  # [n, ctx) never written
            })  # fmt: skip
        # A stale ticket: refused by the header check, before any byte reaches the slot.
        offset, n, generation = staged[0]
        slot, regs = target.allocate_slot(), transport.registrations
        try:
            puller.pull(slot, peer, offset, geo, n, generation + 1)
            result["stale_raised"] = False
        except StaleTicket:
            result["stale_raised"] = True
        result["stale_registrations_unchanged"] = transport.registrations == regs
        pulled = {p["slot"] for p in result["prompts"]}
        untouched = [s for s in range(target.num_slots) if s not in pulled]
        result["untouched_slots"] = untouched
        result["sentinel_intact"] = all(holds_sentinel(target, s) for s in untouched)
        result["registrations"] = transport.registrations  # staging, receive arena, 2 per layer
    finally:
        puller.close()
        transport.close()
        target.close()
    result["registrations_after_close"] = transport.registrations
    result["descriptors_per_pull"] = L * 2 * H
    print("RESULT", json.dumps(result), flush=True)
    ok = all(
        p["correct"] and p["same_as_reference"] and p["tail_sentinel"]
        and p["descriptors"] == L * 2 * H
        for p in result["prompts"]
    )  # fmt: skip
    ok = ok and result["stale_raised"] and result["stale_registrations_unchanged"]
    ok = ok and result["sentinel_intact"] and result["registrations_after_close"] == 0
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("staged", nargs="?", help="decode: the prefill's STAGED json")
    parser.add_argument("--tag", default=f"slot{os.getpid()}")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--ctx", type=int, default=CTX)
    args = parser.parse_args()
    if args.role == "prefill":
        return prefill(args.tag, args.prompts, args.ctx)
    return decode(args.tag, args.staged, args.ctx)


if __name__ == "__main__":
    sys.exit(main())
