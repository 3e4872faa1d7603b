"""Greedy exact-match accuracy of the tiny copy model on held-out prompts.

    python -m scripts.eval_tiny_model --model models/tiny-copy           # expect ~1.0
    python -m scripts.eval_tiny_model --model models/tiny-copy --zero-kv # expect < 0.3

--zero-kv zeroes every K/V of the prompt prefix before decoding, showing that
the answer really depends on the cached prompt (what a KV connector transfers).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from testbed import copy_task as ct
from testbed.shipped_model import greedy_answer


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="models/tiny-copy")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--zero-kv", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    ok = 0
    examples = ct.heldout_prompts(args.n)
    for i, (prompt, answer) in enumerate(examples):
        ids = tok.encode(prompt)
        text = tok.decode(greedy_answer(model, ids, tok.eos_token_id, args.zero_kv))
        ok += ct.is_correct(text, answer)
        if i < 2:
            print(f"[{i}] prompt_tokens={len(ids)} want={answer!r} got={text!r}")
    mode = "zero_kv" if args.zero_kv else "normal"
    print(f"mode={mode} n={len(examples)} exact_match={ok / len(examples):.3f}")


if __name__ == "__main__":
    main()
