"""How far vLLM alone computes one token's logprob apart in its two passes: inside a
prompt's pass (prefill kernels) and in a decode step (decode kernels). A handoff's decode
computes its first token in a decode step over loaded KV where vLLM alone computes it in the
prompt's pass, so this gap bounds what a disaggregated answer can match where the decode
computes that token (chat; completions the proxy cannot start from the prefill's token).

    python -m testbed.kernel_gap --model DIR [--prompts 12] [--dtype float32]

Per prompt P (random token ids, greedy): P answered with max_tokens 2, t1 then t2, t2's
logprob from a decode step; and P + t1 answered with one token, t2 again, its logprob from
the prompt's pass. One vLLM server, no connector.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import requests

from testbed.live_servers import LiveRun, wait_all_ready


def completion(url: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "model", "prompt": prompt, "max_tokens": tokens}
    body.update(temperature=0.0, logprobs=0, return_token_ids=True)
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]


def gaps(url: str, prompts: int, vocab: int, seed: int = 0) -> list[float]:
    """Per prompt, |decode step's logprob - prompt pass's| of one token (the same token)."""
    rng, out = random.Random(seed), []
    for _ in range(prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(60, 250))]
        stepped = completion(url, prompt, 2)
        first, second = stepped["token_ids"]
        passed = completion(url, [*prompt, first], 1)
        assert passed["token_ids"] == [second], "the passes chose other tokens"
        lp = stepped["logprobs"]["token_logprobs"][1], passed["logprobs"]["token_logprobs"][0]
        out.append(abs(lp[0] - lp[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    # Ids the tokenizer knows (a random model's embedding may be larger than its vocabulary)
    vocab = len(json.loads((a.model / "tokenizer.json").read_text())["model"]["vocab"])
    with LiveRun("kernel-gap") as run:
        server = run.vllm("alone", "0", None, model=a.model, extra_args=["--dtype", a.dtype])
        wait_all_ready(server)
        found = gaps(server.url, a.prompts, vocab)
    print(f"[kernel-gap] {a.model.name} {a.dtype}: {len(found)} prompts, logprob gap "
          f"max {max(found):.5f} median {sorted(found)[len(found) // 2]:.5f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
