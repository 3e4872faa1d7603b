"""Writes a random-weights model (no training) with its own tokenizer.

Random models meet what the shipped copy model never does: a tokenizer trained here on
multilingual text (495 tokens: the corpus runs out of merges before VOCAB_SIZE, so many
tokens hold part of a character and a generated token is often not whole UTF-8 text),
another geometry, another architecture.
The output layer is scaled (``--sharpen``) so that the top logit leads by far more than
float32 rounding: two servers that compute the same KV agree token for token, and one that
computes other KV does not.

    python scripts/make_random_model.py OUT_DIR
        [--arch llama|qwen3|gemma3|gemma4_kv_shared|granite_hybrid|deepseek_v2|...]
        [--tokenizer byte_level|sentencepiece]

- llama: grouped-query attention (4 query heads over 2 KV heads of 64), 3 layers.
- qwen3: q/k RMSNorm, 4 KV heads of 64, 3 layers.
- gemma3: 4 layers alternating sliding-window (64) and full attention: vLLM builds a
  hybrid (two-group) KV cache.
- gemma4_kv_shared: Gemma 4's cross-layer KV sharing: of 4 layers (sliding-window and full
  attention alternating) the last two read the KV of the last earlier layer of their kind
  (vLLM's ``kv_sharing_target_layer_name``) and have none of their own.
- granite_hybrid: a GraniteMoeHybrid whose 4 layers alternate Mamba2 and attention: a KV
  cache group plus a Mamba state group.
- llama_8b_kv: Llama-3-8B's KV bytes per token (32 layers, 8 KV heads of 128, bfloat16)
  on a narrow model.
- deepseek_v2: multi-head latent attention (MLA), dense: vLLM's CPU_MLA backend (its
  decode kernel takes latents of 512 + 64 values, in 16-token blocks).
- deepseek_v3_mtp: DeepSeek-V3's MLA with its multi-token-prediction layer (the drafter of
  vLLM's `mtp` speculative method, an MLA layer of its own).

Tokenizers, the two families models ship:
- byte_level: GPT-2's, as Llama 3, Qwen and GPT-NeoX models have it.
- sentencepiece: as Llama 2, Mistral and Gemma ship it converted to tokenizer.json: words
  start with "▁", characters outside a small alphabet fall back to byte tokens
  (``<0xE3>``), the decoder strips the text's first space, and a BOS token is added.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SPECIAL = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
UNK = "<unk>"  # id 3 in a SentencePiece vocabulary
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789;\u2581éöüçßαελρ日本語"  # SentencePiece's
VOCAB_SIZE = 700
SHARPEN = 30.0  # output-layer scale: logits' spread ~10 instead of ~0.3
# Scripts whose characters take 1-4 UTF-8 bytes: a small vocabulary merges only some of
# their byte pairs, so tokens split characters.
TEXT = (
    "the quick brown fox jumps over lazy dogs while numbers 0123456789 count; "
    "héllo wörld façade naïve über straße; ελληνικά κείμενα; русский текст; "
    "日本語のテキストと漢字; 한국어 문장; עברית; العربية; emoji 😀🎉🚀🌍 ✓ → ∑ ≠"
)
WORDS = TEXT.split(" ")


def corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(3000)]


def byte_level(vocab_size: int, seed: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer)
    return tok


def sentencepiece(vocab_size: int, seed: int) -> Tokenizer:
    """A SentencePiece-style BPE tokenizer with byte fallback, as Llama 2's tokenizer.json."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=UNK, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL, UNK],
        initial_alphabet=list(ALPHABET),
        limit_alphabet=len(ALPHABET),  # the rest of the text falls back to bytes
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # plain tokens, as SentencePiece's byte pieces are
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]}  # fmt: skip
    bos = {"SpecialToken": {"id": SPECIAL[1], "type_id": 0}}
    a, b = ({"Sequence": {"id": s, "type_id": i}} for i, s in enumerate("AB"))
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, a],
        "pair": [bos, a, b],
        "special_tokens": {SPECIAL[1]: {"id": SPECIAL[1], "ids": [1], "tokens": [SPECIAL[1]]}},
    }
    return Tokenizer.from_str(json.dumps(spec))


TOKENIZERS = {"byte_level": byte_level, "sentencepiece": sentencepiece}


def train_tokenizer(
    out: Path, family: str = "byte_level", vocab_size: int = VOCAB_SIZE, seed: int = 0
) -> Tokenizer:
    """A tokenizer of ``family``, trained on random sentences of WORDS, saved in ``out``."""
    tok = TOKENIZERS[family](vocab_size, seed)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIAL[0],
        "bos_token": SPECIAL[1],
        "eos_token": SPECIAL[2],
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok


def shared(vocab_size: int) -> dict[str, Any]:
    """Sizes and special ids every architecture uses."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,  # the output layer alone is sharpened
        torch_dtype="float32",
    )


def llama(vocab: int) -> PreTrainedModel:
    return LlamaForCausalLM(
        LlamaConfig(**shared(vocab), num_hidden_layers=3, num_key_value_heads=2)
    )


def qwen3(vocab: int) -> PreTrainedModel:
    """Heads of 80 dims (as Phi-2's and Qwen-1.8B's): vLLM's CPU attention picks ``vec16``."""
    sizes = {**shared(vocab), "head_dim": 80}
    return Qwen3ForCausalLM(Qwen3Config(**sizes, num_hidden_layers=3, num_key_value_heads=4))


def gemma3(vocab: int) -> PreTrainedModel:
    """Layers alternate sliding-window (64 tokens) and full attention: two KV cache groups."""
    cfg = Gemma3TextConfig(
        **shared(vocab),
        num_hidden_layers=4,
        num_key_value_heads=2,
        query_pre_attn_scalar=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
        architectures=["Gemma3ForCausalLM"],
    )
    return Gemma3ForCausalLM(cfg)


def gemma4_kv_shared(vocab: int) -> PreTrainedModel:
    """Layers 2 and 3 attend with layers 0's and 1's KV (``num_kv_shared_layers``)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = Gemma4TextConfig(
        **shared(vocab), num_hidden_layers=4, num_key_value_heads=2, num_kv_shared_layers=2,
        sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": rope, "full_attention": rope},
        hidden_size_per_layer_input=0, per_layer_config={}, architectures=["Gemma4ForCausalLM"],
    )  # fmt: skip
    return Gemma4ForCausalLM(cfg)


def granite_hybrid(vocab: int) -> PreTrainedModel:
    """Layers alternate Mamba2 (recurrent state) and attention, with dense MLPs."""
    sizes = {k: v for k, v in shared(vocab).items() if k != "head_dim"}
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


def llama_8b_kv(vocab: int) -> PreTrainedModel:
    """Llama-3-8B's KV per token (32 layers of 8 KV heads of 128, bfloat16: 128 KiB) on a
    narrow model that computes fast: sizes sized for the tiny model do not hold it."""
    sizes = {**shared(vocab), "num_attention_heads": 8, "head_dim": 128}
    sizes.update(torch_dtype="bfloat16", max_position_embeddings=8192)
    model = LlamaForCausalLM(LlamaConfig(**sizes, num_hidden_layers=32, num_key_value_heads=8))
    return model.to(torch.bfloat16)


def mla_config(config: type, vocab: int, layers: int) -> Any:
    """A DeepSeek config of ``layers`` dense MLA layers (vLLM CPU's MoE router asserts
    DeepSeek's ``topk_group``): a 512 latent and a 64 RoPE key per token (576, the size
    vLLM's CPU MLA decode kernel takes)."""
    sizes = {k: v for k, v in shared(vocab).items() if k != "head_dim"}
    latent = dict(kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64)
    heads = dict(num_key_value_heads=4, qk_nope_head_dim=32, v_head_dim=32)
    dense = dict(first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2)
    return config(
        **sizes, **latent, **heads, **dense, num_hidden_layers=layers, moe_intermediate_size=128,
        architectures=[config.__name__.replace("Config", "ForCausalLM")],
    )  # fmt: skip


def deepseek_v2(vocab: int) -> PreTrainedModel:
    """Multi-head latent attention (MLA): each layer caches one compressed latent (512) and
    a shared RoPE key (64) per token, not per-head K and V. 3 dense layers."""
    return DeepseekV2ForCausalLM(mla_config(DeepseekV2Config, vocab, 3))


def deepseek_v3_mtp(vocab: int) -> PreTrainedModel:
    """DeepSeek-V3's layout: 3 MLA layers and, as ``model.layers.3``, one multi-token
    prediction layer (``num_nextn_predict_layers``: an MLA decoder layer beside the norms of
    the token's embedding and the last hidden state, their projection and a head), which
    vLLM runs as the drafter of its ``mtp`` speculative method. Dense, as deepseek_v2."""
    cfg = mla_config(DeepseekV3Config, vocab, 4)  # the MTP layer built as a fourth
    model = DeepseekV3ForCausalLM(cfg)
    hidden, mtp = cfg.hidden_size, model.model.layers[3]
    mtp.enorm, mtp.hnorm = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
    mtp.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
    mtp.embed_tokens = torch.nn.Embedding(vocab, hidden)
    mtp.embed_tokens.weight.data.copy_(model.model.embed_tokens.weight)
    mtp.shared_head = torch.nn.Module()
    mtp.shared_head.norm = torch.nn.RMSNorm(hidden)
    mtp.shared_head.head = torch.nn.Linear(hidden, vocab, bias=False)
    mtp.shared_head.head.weight.data.copy_(model.lm_head.weight * SHARPEN)
    model.config.num_hidden_layers, model.config.num_nextn_predict_layers = 3, 1
    return model


ARCHS = {
    "llama": llama, "qwen3": qwen3, "gemma3": gemma3, "gemma4_kv_shared": gemma4_kv_shared,
    "granite_hybrid": granite_hybrid,
    "deepseek_v2": deepseek_v2, "deepseek_v3_mtp": deepseek_v3_mtp, "llama_8b_kv": llama_8b_kv,
}  # fmt: skip


def main(
    out: Path, arch: str = "llama", sharpen: float = SHARPEN, tokenizer: str = "byte_level",
    seed: int = 0,
) -> None:  # fmt: skip
    torch.manual_seed(seed)
    tok = train_tokenizer(out, tokenizer, seed=seed)
    model = ARCHS[arch](tok.get_vocab_size())
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output directory")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--sharpen", type=float, default=SHARPEN, help="output-layer scale")
    parser.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="byte_level")
    parser.add_argument("--seed", type=int, default=0, help="weights' and tokenizer's corpus")
    args = parser.parse_args()
    main(args.out, args.arch, args.sharpen, args.tokenizer, args.seed)
