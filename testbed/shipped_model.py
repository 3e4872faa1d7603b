"""The shipped model, ``models/tiny-copy``: where it is and its KV geometry, written once.

Tests that need "a model's KV" use these numbers so that what they build agrees with what a
real server of this model hands over; `tests/unit/test_testbed.py` checks them against the
model's ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
