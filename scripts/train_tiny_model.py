"""Train a tiny Llama on the copy task (CPU, deterministic) and save an HF dir.

Usage: python -m scripts.train_tiny_model --out models/tiny-copy
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from testbed import copy_task as ct


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(ct.VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=ct.UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No decoder: tokenizers then joins tokens with single spaces, which is
    # exactly the word-level text we want back. No post-processor either, so
    # nothing (e.g. <bos>) is auto-added; the prompt text carries <bos> itself.
    tok.add_special_tokens(ct.SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=ct.BOS,
        eos_token=ct.EOS,
        pad_token=ct.PAD,
        unk_token=ct.UNK,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=1024,
    )


def build_model(vocab_size: int, tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(cfg)


def curriculum_max_len(step: int, args: argparse.Namespace) -> int:
    # Start with no filler (prompt ~= string) and grow linearly; without this
    # the model never learns to find the string in long prompts.
    frac = min(1.0, step / max(1, args.curriculum_steps))
    return int(ct.MAX_STRING_LEN + 5 + frac * (args.max_len - ct.MAX_STRING_LEN - 5))


def make_batch(
    rng: random.Random, tok: PreTrainedTokenizerFast, batch: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and labels on answer(+<eos>) only."""
    seqs: list[list[int]] = []
    labels: list[list[int]] = []
    # One length band per batch keeps padding (and CPU time) low.
    hi = rng.randint(1, max_len)
    for _ in range(batch):
        prompt, answer = ct.make_example(rng, prompt_tokens=rng.randint(max(1, hi - 64), hi))
        p = tok.encode(prompt)
        a = tok.encode(answer + " " + ct.EOS)
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(s) for s in seqs)
    pad = tok.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lab = torch.tensor([lbl + [-100] * (width - len(lbl)) for lbl in labels])
    return ids, mask, lab


@torch.no_grad()
def greedy_accuracy(
    model: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    examples: list[tuple[str, str]],
) -> float:
    model.eval()
    ok = 0
    for prompt, answer in examples:
        ids = torch.tensor([tok.encode(prompt)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=ct.answer_max_tokens(),
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        ok += ct.is_correct(text, answer)
    model.train()
    return ok / len(examples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="models/tiny-copy")
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--curriculum-steps", type=int, default=400)
    ap.add_argument("--max-len", type=int, default=440, help="final max prompt tokens")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(args.seed)  # training stream; held-out uses a string seed

    tok = build_tokenizer()
    model = build_model(len(ct.VOCAB), tok)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params={n_params} vocab={len(ct.VOCAB)}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * 0.5 * (1 + math.cos(math.pi * t))

    probe = ct.heldout_prompts(20, seed=99)  # progress probe, not the eval set
    t0 = time.time()
    for step in range(args.steps):
        max_len = curriculum_max_len(step, args)
        ids, mask, lab = make_batch(rng, tok, args.batch, max_len)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(
                f"step={step} loss={loss.item():.4f} max_len={max_len} "
                f"lr={lr_at(step):.2e} t={time.time() - t0:.0f}s",
                flush=True,
            )
        if (step + 1) % args.eval_every == 0:
            acc = greedy_accuracy(model, tok, probe)
            print(f"step={step} probe_exact_match={acc:.2f}", flush=True)

    print(f"train_time={time.time() - t0:.0f}s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # transformers 5 writes tokenizer_class "TokenizersBackend" and no
    # special_tokens_map.json; use the portable class name and write the map
    # so older transformers (and vLLM's tokenizer loading) accept the dir too.
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg_path.write_text(json.dumps(tcfg, indent=2) + "\n")
    special = {"bos_token": ct.BOS, "eos_token": ct.EOS, "pad_token": ct.PAD, "unk_token": ct.UNK}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    # Record how the model was produced, for reproducibility.
    (out / "training_args.json").write_text(json.dumps(vars(args), indent=2) + "\n")
    print(f"saved to {out} ({sum(f.stat().st_size for f in out.iterdir())} bytes)")
    acc = greedy_accuracy(model, tok, ct.heldout_prompts(50))
    print(f"heldout50_exact_match={acc:.3f}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
