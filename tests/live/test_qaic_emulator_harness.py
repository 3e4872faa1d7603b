"""The real prefill vLLM -> QAIC decode emulator handoff through scripts/run_accuracy_test.sh
(DECODE_TARGET=qaic), over shm and NIXL, and its negative control."""

from __future__ import annotations

import json
import re

import pytest

from testbed.live_servers import harness, last_line, random_model
from testbed.shipped_model import MODEL_DIR
from testbed.shm_objects import segments


def _leftovers(tag: str) -> list[str]:
    return sorted(segments(f"qaic_kv_{tag}"))


SLOTS = re.compile(r"qaic decode: slots=(\d+) max_in_use=(\d+) in_use_at_end=(\d+)")


def _run_leftovers(out: str) -> list[str]:
    run_id = re.search(r"\[harness\] run (\S+):", out)
    assert run_id, "no run id"
    return _leftovers(run_id.group(1))


DESCRIPTORS = re.compile(r"programs=(\d+) NIXL descriptors per handoff=(\d+)")


@pytest.mark.daily  # one router and transport a day (CI time); the negative control always
@pytest.mark.parametrize(
    ("transport", "programs", "arch", "router"),
    [("shm", "1", None, "vllm-router"), ("nixl", "2", "qwen3", "proxy"),
     ("nixl", "1", None, "llm-d")],
    ids=["shm-behind-vllm-router", "nixl-layer-split-random-qwen3-sentencepiece",
         "nixl-llm-d-sidecar-streamed"],
)  # fmt: skip
def test_vllm_prefill_to_qaic_emulator(tmp_path_factory, transport, programs, arch, router):
    """The shipped model (whose answers are known) served in vLLM's default bf16 behind
    vLLM's own router, which names no decode (the prefill stages in its own layout), into a
    float16 program: the endpoint converts layout and dtype in its one copy into the slot,
    and 99% of the tokens must agree with aggregated bf16 vLLM (issue 55). And a random
    Qwen3 with a SentencePiece-style tokenizer (4 KV heads of 64, 3 layers, byte pieces:
    its answers must agree with the aggregated server's token for token) behind the proxy,
    which names the decode (staged as a slot: the only host copy is the staging). And the
    shipped model in float32 over NIXL in llm-d's sidecar sequence: a prefill leg, then the
    decode leg streamed with the prefill's params copied whole (no decode named)."""
    model = random_model(tmp_path_factory, arch, "sentencepiece") if arch else MODEL_DIR
    # 8 slots for 16 requests in flight: slots must be waited for, freed and reused.
    rc, out = harness(
        DECODE_TARGET="qaic", NUM_PROMPTS="16", CONCURRENCY="16", QAIC_SLOTS="8",
        KV_CACHE_PREFIX="P0", KV_TRANSPORT=transport, QAIC_PROGRAMS=programs, MODEL=str(model),
        ROUTER=router,
        # float32: only other KV parts answers; bf16 into float16: converted
        **({"DTYPE": "bfloat16", "QAIC_DTYPE": "float16"} if router == "vllm-router" else {}),
        **({"DTYPE": "float32"} if arch else {}),
        **({} if arch else {"LONE_GAPS": "0"}),  # the idle gaps: over NIXL (CI time)
    )  # fmt: skip
    m = last_line(out)
    assert rc == 0, "harness gates failed"
    acc, agg, agreement = float(m.group(1)), float(m.group(2)), float(m.group(3))
    if router != "vllm-router":
        assert agreement == 100.0 and (arch or (acc >= 0.95 and acc == agg))
    else:
        assert "prefill0: dtype=torch.bfloat16" in out and "decode0: float16 KV buffers" in out
        tokens = re.search(r"token agreement: ([\d.]+)% of the aggregated answers' (\d+)", out)
        assert tokens and float(tokens.group(1)) >= 99.0 and int(tokens.group(2)) > 100
        assert acc >= 0.95 and agg >= 0.95
    assert m.group(4) == "16" and m.group(5) == transport
    slots = SLOTS.search(out)
    assert slots, "no slot report"
    assert int(slots.group(1)) == 8 and 1 <= int(slots.group(2)) <= 8
    assert int(slots.group(3)) == 0
    assert f"host copies per handoff: {'1.00' if router == 'proxy' else '2.00'}" in out
    descriptors = DESCRIPTORS.search(out)
    assert descriptors and descriptors.group(1) == programs
    # Staged as a slot over NIXL, one READ descriptor per (layer, K|V, KV head) lands in it;
    # staged in the prefill's layout (no decode named), the READ lands in host memory.
    cfg = json.loads((model / "config.json").read_text())
    reads = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"]
    assert int(descriptors.group(2)) == (reads if (transport, router) == ("nixl", "proxy") else 0)
    assert _run_leftovers(out) == []


def test_qaic_negative_control_fails():
    # Over NIXL: the READ lands in the slot, and zeroing the slot must still be caught.
    rc, out = harness(
        DECODE_TARGET="qaic",
        KV_TRANSPORT="nixl",
        NEGATIVE_CONTROL="1",
        NUM_PROMPTS="16",
        LONE_GAPS="0",
    )
    assert rc != 0
    assert "corrupted KV was detected" in out
    assert float(last_line(out).group(1)) < 0.3
    assert _run_leftovers(out) == []
