"""Writes a random-weights Llama (no training) for harness runs on "any other model".

It borrows the shipped model's tokenizer and uses another geometry (more layers, more KV
heads, head size 64), so the connector meets shapes the copy model does not have.
    python scripts/make_random_model.py OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def main(out: Path) -> None:
    torch.manual_seed(0)
    src = ROOT / "models" / "tiny-copy"
    base = LlamaConfig.from_pretrained(src)
    cfg = LlamaConfig(
        vocab_size=base.vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
