"""Writes a random-weights model (no training) for harness runs on "any other model".

It borrows the shipped model's tokenizer and uses another geometry (more layers, more KV
heads, head size 64), so the connector meets shapes the copy model does not have.
`--arch gemma3` writes a text-only Gemma3 whose 4 layers alternate sliding-window (64)
and full attention, so vLLM builds a hybrid (two-group) KV cache. `--arch granite_hybrid`
writes a GraniteMoeHybrid whose 4 layers alternate Mamba2 and attention: a KV cache group
plus a Mamba state group.
    python scripts/make_random_model.py OUT_DIR [--arch gemma3|granite_hybrid]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def shared(base: LlamaConfig) -> dict[str, Any]:
    """Sizes both architectures use, and the shipped model's vocabulary and special ids."""
    return dict(
        vocab_size=base.vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        torch_dtype="float32",
    )


def llama(base: LlamaConfig) -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**shared(base), num_hidden_layers=3, num_key_value_heads=4))


def gemma3(base: LlamaConfig) -> PreTrainedModel:
    """Layers alternate sliding-window (64 tokens) and full attention: two KV cache groups."""
    cfg = Gemma3TextConfig(
        **shared(base),
        num_hidden_layers=4,
        num_key_value_heads=2,
        query_pre_attn_scalar=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        architectures=["Gemma3ForCausalLM"],
    )
    return Gemma3ForCausalLM(cfg)


def granite_hybrid(base: LlamaConfig) -> PreTrainedModel:
    """Layers alternate Mamba2 (recurrent state) and attention, with dense MLPs."""
    sizes = {k: v for k, v in shared(base).items() if k != "head_dim"}
    cfg = GraniteMoeHybridConfig(
        **sizes,
        num_hidden_layers=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention"] * 2,
        num_local_experts=0,
        shared_intermediate_size=512,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_n_groups=1,
        architectures=["GraniteMoeHybridForCausalLM"],
    )
    return GraniteMoeHybridForCausalLM(cfg)


ARCHS = {"llama": llama, "gemma3": gemma3, "granite_hybrid": granite_hybrid}


def main(out: Path, arch: str = "llama") -> None:
    torch.manual_seed(0)
    src = ROOT / "models" / "tiny-copy"
    ARCHS[arch](LlamaConfig.from_pretrained(src)).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    args = parser.parse_args()
    main(args.out, args.arch)
