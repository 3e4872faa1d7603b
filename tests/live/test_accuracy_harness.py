"""The real thing: `scripts/run_accuracy_test.sh` with two `vllm serve` processes.

Each case starts three vLLM servers (prefill, decode, aggregated), so they run in eager
mode and with few prompts where the point is a layout path rather than concurrency.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testbed.live_servers import harness, harness_leaves_nothing, last_line, random_model, shm_names
from testbed.shipped_model import ROOT

HETERO = {"NUM_PROMPTS": "24", "CONCURRENCY": "8"}
ASYNC = {"ASYNC_SCHEDULING": "1"}  # as vLLM schedules on a GPU (testbed/cpu_async_scheduling.py)
NGRAM_DRAFTS = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}  # fmt: skip


# Each run starts three vLLM servers, so the cases combine independent axes.
@pytest.mark.parametrize(
    "env",
    [
        # Both engines under KV pressure (the fewest blocks max_model_len allows, plus one
        # or two), as a busy fleet runs: vLLM preempts running requests and recomputes them,
        # prefills mid-prompt with saves behind them and decodes after their loads.
        # Chunked prefill: a prompt is preempted after its first chunks were staged.
        # Scheduled asynchronously, as vLLM schedules on a GPU: a step is scheduled before
        # the last one's output is back (vLLM's CPU platform turns it off; the harness
        # launches the servers through testbed/cpu_async_scheduling.py). Concurrency 16:
        # at 12 the decode preempted nothing in one CI run of stop 48 (16, five runs: 5 1 6 4 2).
        {
            **ASYNC,
            "NUM_PROMPTS": "64",
            "CONCURRENCY": "16",
            # A 512-token context lets each engine have 5 blocks (4 + 1): with 9 of a 1024
            # context, 5 of 7 runs of stop 54 put neither engine under pressure in the
            # handoff phase (prefill preemptions all the aggregated run's); with 5, every run
            # preempted 23+ handoffs and the decode 3+ times.
            "MAX_MODEL_LEN": "512",
            "PREFILL_KV_BLOCKS": "5",
            "DECODE_KV_BLOCKS": "5",
            "PREFILL_MAX_NUM_BATCHED_TOKENS": "64",
        },
        # The decode reads the prefill's 32-token blocks straight out of its cache into its
        # 128-token blocks (the proxy names the decode), after the last chunk of a chunked
        # prefill. The decode runs two data-parallel engines, each with its own side channel
        # on the configured port plus its DP rank, and speculative decoding (ngram drafts)
        # over the loaded KV.
        {
            **HETERO,
            "DECODE_SPECULATIVE_CONFIG": json.dumps(NGRAM_DRAFTS),
            "PREFILL_BLOCK_SIZE": "32",
            "DECODE_BLOCK_SIZE": "128",
            "PREFILL_MAX_NUM_BATCHED_TOKENS": "64",
            "DECODER_DP_SIZE": "2",
            "LONE_GAPS": "0",  # the idle gaps: the default case, Llama and Qwen3
        },
        # xPyD over NIXL (2 prefills x 2 decodes, decodes converting) runs on the random
        # Qwen3 below.
        # Prefill TP 2 -> decode TP 1 with 512-token blocks runs in CI on the Mamba hybrid
        # (test_mamba_hybrid_model_moves_its_state_from_tp2_to_tp1), to keep CI short.
    ],
    ids=["default-64x12-kv-pressure-async-scheduling", "p32-d128-chunked-dp2"],
)
def test_disaggregated_matches_aggregated(env):
    rc, out = harness_leaves_nothing(**env)
    m = last_line(out)
    assert rc == 0, "harness gates failed"
    assert float(m.group(1)) >= 0.95 and float(m.group(3)) == 100.0
    assert m.group(4) == env["NUM_PROMPTS"]
    loads = re.search(r"loaded_requests=(\d+) .* direct_reads=(\d+)", out)
    assert loads, out
    if "PREFILL_KV_BLOCKS" in env:
        lines = r"^(prefill|decode) :\d+ .* preemptions=(\d+) of them handoffs=(\d+)$"
        preempted = {role: (int(n), int(h)) for role, n, h in re.findall(lines, out, re.M)}
        assert preempted["decode"][0] > 0, f"no KV pressure on the decode: {preempted}"
        assert preempted["prefill"][1] > 0, f"no handoff preempted on the prefill: {preempted}"
    else:  # shm: every load copies out of the prefill's cache, block sizes equal or not
        assert int(loads.group(2)) == int(loads.group(1))
    if env.get("ASYNC_SCHEDULING") == "1":
        assert "async scheduling (batch queue of 2, as on a GPU) in 2 of 2 vLLM servers" in out
    if "DECODE_SPECULATIVE_CONFIG" in env:
        accepted = re.search(r"speculative tokens accepted=(\d+)", out)
        assert accepted and int(accepted.group(1)) > 0, "no draft token was accepted"


AMX_HOST = "amx_tile" in Path("/proc/cpuinfo").read_text()


@pytest.mark.parametrize(
    ("env", "packs"),
    [
        ({"NO_AMX": "decode"}, {"prefill0": "amx", "decode0": "vec"}),
        ({"NO_AMX": "prefill"}, {"prefill0": "vec", "decode0": "amx"}),
        # The QAIC decode's program holds bf16 KV: an amx prefill stages it in slot layout.
        ({"DECODE_TARGET": "qaic", "QAIC_DTYPE": "bfloat16"}, {"prefill0": "amx"}),
    ],
    ids=["amx-prefill-to-vec-decode", "vec-prefill-to-amx-decode", "amx-prefill-to-qaic"],
)
def test_peers_on_two_kinds_of_cpu_convert(env, packs):
    """On an AMX host, with vLLM's default dtype (bf16), one engine made to see no AMX
    tiles packs KV as an AVX-512 host does: the two packings meet and convert, every
    answer equal to aggregated and every request from loaded KV."""
    if not AMX_HOST:
        pytest.skip(
            "no AMX tiles on this host: vLLM packs no KV as amx here (vllm_cpu_amx "
            "is checked live on AMX hosts, byte-exactly here in test_worker_ranks)"
        )
    rc, out = harness_leaves_nothing(NUM_PROMPTS="16", CONCURRENCY="8", LONE_GAPS="0", **env)
    assert rc == 0, "harness gates failed"
    for server, isa in packs.items():
        assert f"{server}: vLLM CPU attention ISA {isa} packs KV as vllm_cpu_{isa}" in out
    m = last_line(out)
    assert m.group(4) == "16" and float(m.group(3)) >= (99.0 if "DECODE_TARGET" in env else 100.0)
    if "DECODE_TARGET" not in env:  # (the QAIC harness gates its slot loads itself)
        loads = re.search(r"loaded_requests=(\d+) .*load_failures=(\d+)", out)
        assert loads and int(loads.group(1)) == 16 and int(loads.group(2)) == 0, out[-2000:]


def test_negative_control_fails_loudly():
    rc, out = harness_leaves_nothing(
        NEGATIVE_CONTROL="1", NUM_PROMPTS="16", CONCURRENCY="8", LONE_GAPS="0"
    )
    assert rc != 0
    assert "corrupted KV was detected" in out
    assert float(last_line(out).group(1)) < 0.3  # zeroed KV: the model cannot answer


def run_servers() -> set[str]:
    """Pids of the processes a harness run starts: vLLM servers, proxy, QAIC emulator."""
    pattern = (
        "vllm.entrypoints.openai.api_server|testbed.cpu_async_scheduling|vllm_qaic_proxy|"
        "emulator.qaic_emulator"
    )
    ps = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return set(ps.stdout.split())


def test_interrupted_run_stops_everything():
    """SIGINT while the servers start: every process of the run stops, nothing stays in /dev/shm."""
    before, servers_before = shm_names(), run_servers()
    proc = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "run_accuracy_test.sh")],
        env={**os.environ, "NUM_PROMPTS": "4"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        # A shell started in the background (as CI may start us) inherits SIGINT ignored,
        # and bash cannot trap a signal ignored on entry: give it Ctrl-C as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # setup lines first, then the run's
        if line.startswith("[harness] run"):
            break
    time.sleep(10)  # servers are loading the model
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, out
    time.sleep(1)
    assert run_servers() - servers_before == set(), "a process of the interrupted run survived"
    assert shm_names() - before == set(), "the interrupted run leaked shared-memory objects"


def test_unsupported_combination_exits_with_one_line_reason():
    rc, out = harness(DECODE_TARGET="qaic", PREFILLER_TP_SIZE="2", NUM_PROMPTS="1")
    assert rc != 0 and "unsupported:" in out


# Random models with their own tokenizers (scripts/make_random_model.py), byte-level BPE or,
# as Gemma ships it, SentencePiece-style with byte pieces: generated tokens are often not
# whole UTF-8 text, and special tokens come up. Two prefills (blocks 128 and 32) x two
# decodes (32 and 128) unless a case says otherwise, with the proxy's defaults (the first
# token from the prefill where that is exact). float32, so that only other KV can part
# answers.
MIXED_BLOCKS = {
    "NUM_PREFILL_INSTANCES": "2", "NUM_DECODE_INSTANCES": "2", "PREFILL_BLOCK_SIZE": "128 32",
    "DECODE_BLOCK_SIZE": "32 128", "DTYPE": "float32", "NUM_PROMPTS": "16",
}  # fmt: skip
ONE_PAIR = {"NUM_PREFILL_INSTANCES": "1", "NUM_DECODE_INSTANCES": "1", "PREFILL_BLOCK_SIZE": "128",
            "DECODE_BLOCK_SIZE": "32"}  # fmt: skip


@pytest.mark.daily  # one model family a day (CI time); ALL_CASES=1 runs all four
@pytest.mark.parametrize(
    ("arch", "tokenizer", "env"),
    [
        # Grouped-query attention, one pair (128 -> 32) over NIXL with the idle gaps, behind
        # vLLM's own Rust P/D router (`vllm-router`, test extras) instead of the proxy: it
        # sends the prefill `max_tokens: 1`, copies its `kv_transfer_params` whole into the
        # decode leg, names no decode and takes no first token from the prefill, so the
        # prefill stages in its own layout and the decode re-blocks and computes its first
        # token. (tests/live/test_vllm_router.py runs the router over shm.)
        ("llama", "byte_level", {**ONE_PAIR, "ROUTER": "vllm-router", "KV_TRANSPORT": "nixl"}),
        # q/k-norm; over NIXL, the decode converts from each prefill's own format (2P1D:
        # 128 -> 32 and 32 -> 32; the router test's fleet runs 2P2D). Scheduled
        # asynchronously, as on a GPU.
        ("qwen3", "byte_level", {"KV_TRANSPORT": "nixl", "STAGE_AT": "decode", **ASYNC,
                                 "NUM_DECODE_INSTANCES": "1", "DECODE_BLOCK_SIZE": "32",
                                 "LONE_GAPS": "0"}),
        # Sliding window + full attention: two KV cache groups (HMA on), one pair the
        # other way (32 -> 128): CI time.
        ("gemma3", "sentencepiece", {**ONE_PAIR, "PREFILL_BLOCK_SIZE": "32",
                                     "DECODE_BLOCK_SIZE": "128", "LONE_GAPS": "0"}),
        # Layers 2 and 3 read 0's and 1's KV (Gemma 4's KV sharing), 4 requests at once:
        # staging all 4 layers (before the fix) gave 3 HTTP 500s and 81% agreement here.
        ("gemma4_kv_shared", "byte_level", {**ONE_PAIR, "CONCURRENCY": "4", "LONE_GAPS": "0"}),
    ],
    ids=["llama-gqa-nixl-vllm-router", "qwen3-nixl-decode-converts",
         "gemma3-hybrid-sentencepiece-shm", "gemma4-kv-shared-layers-shm"],
)  # fmt: skip
def test_random_models_with_their_own_tokenizers_agree_token_for_token(
    tmp_path_factory, arch, tokenizer, env
):
    model = random_model(tmp_path_factory, arch, tokenizer)
    rc, out = harness_leaves_nothing(MODEL=str(model), **{**MIXED_BLOCKS, **env})
    m = last_line(out)
    assert rc == 0, "harness gates failed"
    assert float(m.group(3)) == 100.0 and m.group(4) == "16"  # token ids and text
    if env.get("NUM_PREFILL_INSTANCES") != "1":  # the decode loaded from both prefills
        assert "decode 0 loaded requests by prefill engine" in out
    loads = re.search(r"loaded_requests=(\d+) .*load_failures=(\d+)", out)
    assert loads and int(loads.group(2)) == 0, out[-2000:]
    if env.get("ROUTER") == "vllm-router":  # a decode leg for every request: all loaded
        assert "vllm-router ready" in out
        assert int(loads.group(1)) == 16 + 3  # and the lone ones, after gaps of 0, 2, 15 s
    if arch == "qwen3":  # heads of 80 dims: vLLM's vec16 kernels, on every x86 host
        assert "decode0: vLLM CPU attention ISA vec16 packs KV as vllm_cpu_vec" in out
    if arch == "gemma4_kv_shared":  # each physical cache once
        assert re.search(r"prefill0: \S+ layout, 2 layers", out), out[-2000:]
    if arch == "gemma3":
        cfg = json.loads((model / "config.json").read_text())
        # Full-length KV of every layer, float32; the sliding-window layers (half of them)
        # move only the window's blocks of 60-300-token prompts.
        full = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
        moved = float(re.search(r"bytes_per_loaded_token=([\d.]+)", out).group(1))
        print(f"[hybrid] bytes per loaded token {moved:.0f}, full-length KV {full}")
        assert full / 2 < moved < 0.85 * full


@pytest.fixture(scope="module")
def mamba_model(tmp_path_factory) -> Path:
    """Random weights: a GraniteMoeHybrid whose 4 layers alternate Mamba2 and attention, so
    vLLM gives it a Mamba state group beside its KV cache group."""
    return random_model(tmp_path_factory, "granite_hybrid")


def test_mamba_hybrid_model_moves_its_state_from_tp2_to_tp1(mamba_model):
    """vLLM on CPU keeps one Mamba state block per request only without prefix caching.
    The prefill stops a token short; the decode loads the KV and the state and recomputes
    the last prompt token from that state. The prefill runs TP 2, the decode TP 1 with
    512-token blocks: the decode re-blocks the KV, reads each KV head from the prefill rank
    holding it, and gathers each Mamba layer's conv channels and SSM heads from both ranks
    (with the state gather switched off, agreement measured 0%; the negative control,
    zeroed KV and state, is test_mamba_faults.py's test_d). Served in float32: in
    bf16 the decode's state update and the reference's prefill scan round differently,
    and this random model's near-tied answers part after a dozen words in some prompts."""
    rc, out = harness_leaves_nothing(
        MODEL=str(mamba_model), NUM_PROMPTS="8", PREFIX_CACHING="0", DTYPE="float32",
        PREFILLER_TP_SIZE="2", DECODE_BLOCK_SIZE="512", LONE_GAPS="0",
        LONE_FIRST_MAX_S="40",  # this model's first request on a fresh TP 2 vLLM: 15 s
    )  # fmt: skip
    assert rc == 0 and float(last_line(out).group(3)) == 100.0
    loads = re.search(r"loaded_tokens=(\d+) .*prompt_tokens=(\d+) handoffs=(\d+)", out)
    assert loads, out[-2000:]
    assert int(loads.group(3)) == 9  # 8 prompts, and the lone request before them
    assert int(loads.group(1)) == int(loads.group(2)) - 9  # one token short per prompt


MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 1})


@pytest.mark.daily  # one of the two a day (CI time)
@pytest.mark.parametrize(
    ("arch", "env"),
    [("deepseek_v2", {"KV_TRANSPORT": "nixl", "PREFILLER_TP_SIZE": "2"}),
     ("deepseek_v3_mtp", {"KV_TRANSPORT": "shm", "PREFILL_SPECULATIVE_CONFIG": MTP,
                          "DECODE_SPECULATIVE_CONFIG": MTP})],
    ids=["nixl-prefill-tp2-to-tp1", "shm-direct-reads-mtp-drafter"],
)  # fmt: skip
def test_a_multi_head_latent_attention_model_hands_its_latent_off(tmp_path_factory, arch, env):
    """A DeepSeek-V2-style random model (MLA, a 512 + 64 latent per token, its own
    byte-level tokenizer) on vLLM's CPU_MLA backend (16-token blocks, no prefix cache),
    float32. Over NIXL from a TP 2 prefill: the latent is the same on both ranks, the
    decode reads it once (bytes per loaded token: one latent per layer) and both ranks'
    staging is freed. Over shm, DeepSeek-V3's layout with its multi-token-prediction layer,
    both engines drafting with it (vLLM's ``mtp`` method): the drafter's MLA layer is handed
    off with the model's, and the decode reads the prefill's blocks whole (direct reads: at
    most a block's tail more). A decode of TP 2 runs in test_worker_ranks. One request at
    a time: vLLM alone answers this model's prompts otherwise when other requests share
    their batches (measured, aggregated: 3 of these 9 answers differ between CONCURRENCY=1
    and 4, the same 3 in two runs), so only unbatched answers compare token for token."""
    model = random_model(tmp_path_factory, arch)
    rc, out = harness_leaves_nothing(
        MODEL=str(model), DTYPE="float32", NUM_PROMPTS="6", CONCURRENCY="1", LONE_GAPS="0",
        LONE_FIRST_MAX_S="40", **env,  # the first request on a fresh TP 2 vLLM: 14 s
    )  # fmt: skip
    cfg = json.loads((model / "config.json").read_text())
    layers = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
    for engine in ("prefill0", "decode0"):
        assert f"{engine}: mla_latent layout, {layers} layers, block 16" in out
    assert rc == 0 and float(last_line(out).group(3)) == 100.0
    loads = re.search(
        r"loaded_requests=(\d+) .*load_failures=(\d+) direct_reads=(\d+).*"
        r"bytes_per_loaded_token=([\d.]+)", out,
    )  # fmt: skip
    assert loads, out[-2000:]
    per_token = layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    loaded, failed, direct, moved = (float(g) for g in loads.groups())
    assert (loaded, failed) == (7, 0)  # and the lone request
    if env["KV_TRANSPORT"] == "nixl":
        assert (direct, moved) == (0, per_token)  # one rank's copy, never both
    else:  # whole 16-token blocks of 288+ token prompts
        assert direct == 7 and per_token <= moved < per_token * (1 + 16 / 288)
        drafted = re.search(r"speculative tokens accepted=\d+ of drafted=(\d+)", out)
        assert drafted and int(drafted.group(1)) > 0, "the decode drafted nothing"
