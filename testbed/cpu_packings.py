"""Every vLLM CPU attention ISA's cache write, tried on this host against the packing we
say it writes: one line per case, ``isa dtype block head -> verdict``. Verdicts: the packing
it proved, ``mismatch`` (a wrong packing of ours), or ``cannot run here: ...`` (vLLM's build
for this host lacks that ISA's kernel). Run as a subprocess: an ISA's kernel could stop the
process with SIGILL, and the last line printed then names it."""

from __future__ import annotations

import torch

from vllm_qaic_connector.kv.layout_probe import ISA_PACKINGS, matches_vllm_op
from vllm_qaic_connector.layout import KVGeometry

CASES = [  # (dtype, block, head): what each ISA accepts in vLLM 0.32
    (torch.bfloat16, 32, 64), (torch.bfloat16, 128, 128), (torch.float32, 64, 32),
    (torch.float16, 32, 64), (torch.bfloat16, 32, 80),
]  # fmt: skip


def verdict(isa: str, geo: KVGeometry) -> str:
    try:
        proven = [k for k in ISA_PACKINGS[isa] if matches_vllm_op(k, isa, geo)]
    except RuntimeError as e:  # vLLM: "Unsupported CPU attention configuration: ..."
        return f"cannot run here: {str(e).splitlines()[0]}"
    return proven[0] if proven else "mismatch"


def picked(isa: str, dtype: torch.dtype, head: int) -> bool:
    """Whether vLLM 0.32 would pick ``isa`` for such a cache (`_get_attn_isa`): amx only
    for bf16 at head sizes a multiple of 32. An AVX-512 host's build runs amx's cache write
    for float32 too, packed otherwise; vLLM never serves a cache that way."""
    return isa != "amx" or (dtype == torch.bfloat16 and head % 32 == 0)


def main() -> None:
    torch.set_num_threads(1)
    for isa in ISA_PACKINGS:
        for dtype, bs, head in (c for c in CASES if picked(isa, c[0], c[2])):
            case = f"{isa} {str(dtype).removeprefix('torch.')} {bs} {head}"
            print(case, "->", end=" ", flush=True)  # a SIGILL leaves this line open
            print(verdict(isa, KVGeometry(2, head, bs, dtype)), flush=True)


if __name__ == "__main__":
    main()
