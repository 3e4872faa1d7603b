"""The weights fingerprint peers compare: one checkpoint has one wherever it lies (a folder
of any name, the hub cache's snapshot), and other weights of the same shapes have another."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from testbed.live_servers import lora_adapter, model_copy
from testbed.shipped_model import MODEL_DIR
from vllm_qaic_connector.model_weights import (
    adapter_fingerprint,
    checkpoint_fingerprint,
    checkpoint_folder,
    kv_settings,
    sample_offsets,
)

SETTINGS = kv_settings(None, SimpleNamespace(rope_theta=10000.0))  # no quantization, plain RoPE


def fingerprint(folder: Path, settings: str = SETTINGS) -> str:
    return checkpoint_fingerprint(folder, settings)


def test_one_checkpoint_in_two_folders_of_other_names_has_one_fingerprint(tmp_path):
    here = fingerprint(MODEL_DIR)
    assert len(here) == 16
    assert fingerprint(model_copy(tmp_path / "local-copy")) == here


def test_a_hub_id_finds_the_hub_cache_s_snapshot_and_the_same_fingerprint(tmp_path):
    """The hub cache's layout as huggingface_hub writes it; read with no network."""
    repo = tmp_path / "models--org--tiny-copy"
    shutil.copytree(MODEL_DIR, repo / "snapshots" / ("c0ffee" * 6 + "c0ff"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee" * 6 + "c0ff")
    folder = checkpoint_folder("org/tiny-copy", None, str(tmp_path))
    assert folder is not None and fingerprint(folder) == fingerprint(MODEL_DIR)
    assert checkpoint_folder("org/not-downloaded", None, str(tmp_path)) is None


@pytest.mark.parametrize(
    "change",
    ["same function, other V", "one tensor fine-tuned", "bfloat16", "quantization setting"],
)
def test_other_weights_of_the_same_shapes_have_another_fingerprint(tmp_path, change):
    if change == "same function, other V":
        folder = model_copy(tmp_path / MODEL_DIR.name, other_kv=True)
    else:
        folder = model_copy(tmp_path / MODEL_DIR.name)
        weights = folder / "model.safetensors"
        tensors = load_file(weights)
        if change == "one tensor fine-tuned":
            name = "model.layers.1.self_attn.k_proj.weight"
            tensors[name] = tensors[name] * 1.001
        elif change == "bfloat16":
            tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
        save_file(tensors, weights, metadata={"format": "pt"})
    settings = (
        kv_settings("fp8", SimpleNamespace(rope_theta=10000.0))
        if change == "quantization setting"
        else SETTINGS
    )
    assert fingerprint(folder, settings) != fingerprint(MODEL_DIR)


def test_kv_settings_read_rope_as_the_config_spells_it():
    plain = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    same = SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "default"})
    scaled = SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert kv_settings(None, plain) == kv_settings(None, same) != kv_settings(None, scaled)


def test_other_weights_files_are_sampled_and_a_folder_without_any_has_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert fingerprint(tmp_path) == ""  # vLLM's dummy weights, a remote loader
    data = bytearray(range(256)) * 512  # 128 KiB: the 64 samples of 4 KiB cover it
    (tmp_path / "pytorch_model.bin").write_bytes(bytes(data))
    first = fingerprint(tmp_path)
    data[70_000] ^= 1
    (tmp_path / "pytorch_model.bin").write_bytes(bytes(data))
    assert first and fingerprint(tmp_path) != first


def test_samples_spread_over_the_range_and_stay_inside_it():
    assert sample_offsets(100, 1100, 3, 64) == [100, 568, 1036]
    assert sample_offsets(0, 10, 3, 64) == [0]  # shorter than a sample: one read
    spread = sample_offsets(0, 1 << 30, 64, 4096)
    assert len(spread) == 64 and spread[-1] == (1 << 30) - 4096


def lora(name: str, path: Path | str) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(path))  # a LoRARequest


def test_a_lora_adapter_is_told_by_its_files_not_its_name(tmp_path):
    """One adapter under two names and folders is one; another adapter under the same name,
    one rewritten in place, or one with another scaling is another; no adapter is ""."""
    assert adapter_fingerprint(None) == ""
    adapter = lora_adapter(tmp_path / "a", seed=1)
    first = adapter_fingerprint(lora("support", adapter))
    assert len(first) == 16
    assert adapter_fingerprint(lora("helpdesk", shutil.copytree(adapter, tmp_path / "b"))) == first
    assert adapter_fingerprint(lora("support", lora_adapter(tmp_path / "c", seed=2))) != first
    shutil.rmtree(adapter)
    lora_adapter(adapter, seed=2)  # reloaded in place: same name, same path, same sizes
    assert adapter_fingerprint(lora("support", adapter)) not in ("", first)
    config = adapter / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 32'))
    scaled = adapter_fingerprint(lora("support", adapter))
    assert scaled != adapter_fingerprint(lora("support", lora_adapter(tmp_path / "d", seed=2)))


def test_an_adapter_whose_files_are_not_here_is_told_by_its_name(tmp_path):
    assert adapter_fingerprint(lora("support", tmp_path / "absent")) == "name:support"
    assert adapter_fingerprint(lora("support", "")) == "name:support"


def test_longrope_kv_depends_on_max_model_len_past_the_original_context():
    """vLLM's LongRoPE (Phi-3 and kin) applies its long factors where max_model_len passes
    the original context, so two engines on one checkpoint with 4k and 128k contexts
    compute other KV; for plain RoPE max_model_len changes nothing."""
    longrope = SimpleNamespace(rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 4096,
        "short_factor": [1.0], "long_factor": [2.0],
    })  # fmt: skip
    assert kv_settings(None, longrope, 4096) != kv_settings(None, longrope, 131072)
    assert kv_settings(None, longrope, 131072) == kv_settings(None, longrope, 65536)
    plain = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert kv_settings(None, plain, 4096) == kv_settings(None, plain, 131072)
