"""Synthetic copy task shared by the tiny-model trainer and the accuracy harness.

Pure Python (no torch) so the harness can import it cheaply: ``from testbed import
copy_task``.

Prompt: ``<bos> f3 f9 … [ s17 s3 … s40 ] f1 … ? [``
Answer: ``s17 s3 … s40 ]`` (the model then emits ``<eos>``).

Answering requires attending back to the bracketed string, which may sit in any
KV block of the prompt, so a broken KV transfer shows up as wrong answers.
"""

from __future__ import annotations

import random

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: list[str] = [PAD, BOS, EOS, UNK]
SYMBOLS: list[str] = [f"s{i}" for i in range(200)]
FILLERS: list[str] = [f"f{i}" for i in range(100)]
OPEN, CLOSE, QUERY = "[", "]", "?"
VOCAB: list[str] = SPECIAL_TOKENS + SYMBOLS + FILLERS + [OPEN, CLOSE, QUERY]

MIN_STRING_LEN = 8
MAX_STRING_LEN = 16
# Held-out prompts span several KV blocks of 32/64/128 tokens.
EVAL_MIN_PROMPT_TOKENS = 100
EVAL_MAX_PROMPT_TOKENS = 400
# Prompt tokens that are not filler: <bos> [ ] ? [  (plus the string itself).
_FIXED_TOKENS = 5


def make_example(
    rng: random.Random,
    prompt_tokens: int | None = None,
    min_prompt_tokens: int = EVAL_MIN_PROMPT_TOKENS,
    max_prompt_tokens: int = EVAL_MAX_PROMPT_TOKENS,
    min_string_len: int = MIN_STRING_LEN,
    max_string_len: int = MAX_STRING_LEN,
) -> tuple[str, str]:
    """Return (prompt_text, answer_text), both space-separated words.

    ``prompt_tokens`` fixes the prompt length; otherwise it is drawn uniformly
    from [min_prompt_tokens, max_prompt_tokens]. If the requested length is
    shorter than the string needs, no filler is used (curriculum start).
    The answer excludes ``<eos>``; training appends it.
    """
    n_sym = rng.randint(min_string_len, max_string_len)
    string = [rng.choice(SYMBOLS) for _ in range(n_sym)]
    if prompt_tokens is None:
        prompt_tokens = rng.randint(min_prompt_tokens, max_prompt_tokens)
    n_fill = max(0, prompt_tokens - n_sym - _FIXED_TOKENS)
    n_before = rng.randint(0, n_fill)  # string lands at a random position
    before = [rng.choice(FILLERS) for _ in range(n_before)]
    after = [rng.choice(FILLERS) for _ in range(n_fill - n_before)]
    prompt = [BOS, *before, OPEN, *string, CLOSE, *after, QUERY, OPEN]
    answer = [*string, CLOSE]
    return " ".join(prompt), " ".join(answer)


def heldout_prompts(n: int, seed: int = 1234) -> list[tuple[str, str]]:
    """Deterministic held-out set; training uses seeds far from 1234."""
    rng = random.Random(f"copy-task-heldout-{seed}")
    return [make_example(rng) for _ in range(n)]


def _words(text: str) -> list[str]:
    # Tolerate detokenizers that glue brackets to symbols ("s3]").
    return text.replace(CLOSE, f" {CLOSE} ").replace(OPEN, f" {OPEN} ").split()


def is_correct(completion_text: str, answer_text: str) -> bool:
    """Exact match of generated words up to and including the first ``]``."""
    want = [w for w in _words(answer_text) if w != EOS]
    got = _words(completion_text)
    if CLOSE in got:
        got = got[: got.index(CLOSE) + 1]
    return got == want


def answer_max_tokens() -> int:
    """Enough tokens for the longest answer (16 symbols + ``]`` + ``<eos>``)."""
    return 20


def token_agreement(disagg: list[dict], agg: list[dict]) -> tuple[float, int]:
    """The share of the reference's tokens the disaggregated answers match, each answer
    counted up to where it first parts from its reference (everything after counts as
    different), and the reference's token count."""
    same = total = 0
    for d, a in zip(disagg, agg, strict=False):
        ref, got = a.get("token_ids") or [], d.get("token_ids") or []
        total += len(ref)
        pairs = enumerate(zip(ref, got, strict=False))
        same += next((i for i, (x, y) in pairs if x != y), min(len(ref), len(got)))
    return 100.0 * same / max(total, 1), total
