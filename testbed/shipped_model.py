"""The shipped model, ``models/tiny-copy``: where it is and its KV geometry, written once.

Tests that need "a model's KV" use these numbers so that what they build agrees with what a
real server of this model hands over; `tests/unit/test_testbed.py` checks them against the
model's ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = ROOT / ".venv" / "bin" / "python"
MODEL_DIR = ROOT / "models" / "tiny-copy"


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: str  # torch dtype name of the checkpoint
    eos: int
    max_model_len: int


TINY = Geometry(
    name="tiny-copy", layers=2, kv_heads=2, head_size=32, dtype="float32", eos=2,
    max_model_len=1024,
)  # fmt: skip


def greedy_answer(model: Any, prompt_ids: list[int], eos_id: int, zero_kv: bool) -> list[int]:
    """A transformers model's greedy answer the way a decode computes it: the prompt but
    its last token prefilled (that cache optionally zeroed), then decoded from the last
    prompt token, up to the copy task's longest answer or eos (left out)."""
    import torch

    from testbed import copy_task as ct

    # Prefill all but the last prompt token, optionally wipe that cache, then
    # decode starting from the last prompt token (same path in both modes).
    prefix = torch.tensor([prompt_ids[:-1]])
    cache = model(input_ids=prefix, use_cache=True).past_key_values
    if zero_kv:
        for layer in cache.layers:
            layer.keys.zero_()
            layer.values.zero_()
    nxt = prompt_ids[-1]
    out: list[int] = []
    for _ in range(ct.answer_max_tokens()):
        res = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        cache = res.past_key_values
        nxt = int(res.logits[0, -1].argmax())
        if nxt == eos_id:
            break
        out.append(nxt)
    return out
