"""The shared test bed: the tiny model's geometry is the shipped model's, and the one vLLM
launcher's command line and readiness wait."""

from __future__ import annotations

import json

import pytest

from testbed import serve
from testbed.model import MODEL_DIR, TINY


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
        eager=False, hma=False, prefix_caching=False, extra=["--max-num-seqs", "4"],
    )  # fmt: skip
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
