"""The shared test bed: the tiny model's geometry is the shipped model's, and the one vLLM
launcher's command line and readiness wait."""

from __future__ import annotations

import json
import subprocess

import pytest

from testbed import serve
from testbed.shipped_model import MODEL_DIR, PY, ROOT, TINY


def test_the_tiny_geometry_is_the_shipped_models() -> None:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert MODEL_DIR.name == TINY.name
    assert cfg["num_hidden_layers"] == TINY.layers
    assert cfg["num_key_value_heads"] == TINY.kv_heads
    assert cfg["head_dim"] == TINY.head_size
    assert cfg["dtype"] == TINY.dtype
    assert cfg["eos_token_id"] == TINY.eos
    assert cfg["max_position_embeddings"] == TINY.max_model_len


def test_the_launcher_builds_one_command_line_for_every_option() -> None:
    plain = serve.vllm_argv(8000)
    assert plain[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in plain and "--kv-transfer-config" not in plain
    assert plain[plain.index("--block-size") + 1] == "128"
    every = serve.vllm_argv(
        8000, block_size=32, kv={"kv_role": "kv_producer"}, tp=2, dtype="float32",
        eager=False, hma=False, prefix_caching=False, async_scheduling=True,
        extra=["--max-num-seqs", "4"],
    )  # fmt: skip
    assert every[1:3] == ["-m", "testbed.cpu_async_scheduling"] and "--async-scheduling" in every
    assert "--enforce-eager" not in every
    for flag in ("--disable-hybrid-kv-cache-manager", "--no-enable-prefix-caching"):
        assert flag in every
    assert every[every.index("--tensor-parallel-size") + 1] == "2"
    assert json.loads(every[every.index("--kv-transfer-config") + 1]) == {"kv_role": "kv_producer"}
    assert every[-2:] == ["--max-num-seqs", "4"]


def test_the_launcher_gives_each_server_its_own_folders_and_core(tmp_path) -> None:
    env = serve.vllm_env("1", tmp_path / "decode0", base={"PATH": "/bin"}, extra={"X": "y"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["X"] == "y"
    assert env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
    assert env["TMPDIR"] == str(tmp_path / "decode0" / "tmp")
    assert (tmp_path / "decode0" / "cache" / "modelinfos").resolve() == serve.MODELINFOS.resolve()
    serve.vllm_env("1", tmp_path / "decode0")  # a second start in the same folder


def test_the_readiness_wait_stops_when_the_server_is_gone() -> None:
    with pytest.raises(serve.NotReady, match="exited"):
        serve.wait_healthy("http://127.0.0.1:9", lambda: "exited with 1", timeout=5)
    with pytest.raises(serve.NotReady, match="not ready"):
        serve.wait_healthy("http://127.0.0.1:9", lambda: None, timeout=0, interval=0)


ASYNC_CONFIG = """
import sys
from vllm.engine.arg_utils import EngineArgs
if sys.argv[1] == "launcher":
    import testbed.cpu_async_scheduling  # noqa: F401
args = EngineArgs(model=sys.argv[2], max_model_len=1024, async_scheduling=True)
config = args.create_engine_config()
print("RESULT", config.scheduler_config.async_scheduling, config.max_concurrent_batches)
"""


@pytest.mark.parametrize(("how", "expected"), [("plain", "False 1"), ("launcher", "True 2")])
def test_the_async_scheduling_launcher_gives_the_engine_vllm_s_batch_queue(how, expected):
    """vLLM's CPU platform turns async scheduling off even when asked; through
    testbed/cpu_async_scheduling.py the engine's config keeps it, with the batch queue of 2
    that a GPU engine runs (each case in its own process: the launcher patches vLLM)."""
    out = subprocess.run(
        [str(PY), "-c", ASYNC_CONFIG, how, str(MODEL_DIR)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert result == [f"RESULT {expected}"], out.stderr[-2000:]


def test_the_harness_draws_its_text_prompts_once_per_run(tmp_path) -> None:
    """Each step of a run asks for a prefix of one seeded list: the kept draw answers the
    later steps (no tokenizer load) with exactly the prompts a fresh draw gives."""
    from scripts.accuracy_check import build_prompts

    model, kept = str(MODEL_DIR), tmp_path / "prompts.json"
    fresh = build_prompts("text", 5, model)
    assert build_prompts("text", 3, model) == fresh[:3]  # a shorter draw is a prefix
    assert build_prompts("text", 4, model, str(kept)) == fresh[:4] and kept.exists()
    kept.write_text(json.dumps(["kept", "prompts", "only", "here"]))
    assert [p for p, _ in build_prompts("text", 2, model, str(kept))] == ["kept", "prompts"]
    assert build_prompts("text", 5, model, str(kept)) == fresh  # more than kept: drawn again
    assert len(json.loads(kept.read_text())) == 5
