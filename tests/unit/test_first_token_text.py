"""The client's text through the proxy's first-token path equals the aggregated server's,
token for token, as vLLM's own detokenizer writes both.

vLLM detokenizes incrementally (`FastIncrementalDetokenizer`, a tokenizers `DecodeStream`
primed with the prompt). A decode whose prompt is the prompt plus the prefill's token
primes its stream differently from an aggregated server that generated that token, and
where the token is not whole UTF-8 text the two texts part. Here tokenizers trained like the
random models' (byte-level BPE, whose tokens often split characters, and SentencePiece-style,
with byte pieces and a decoder that strips the text's first space) and vLLM's detokenizer play
the three servers: aggregated, prefill (one token) and decode (the rest), and the proxy's
`FirstToken` joins the last two, or declines and leaves the first token to the decode.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.tokenizers import get_tokenizer
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from scripts.make_random_model import SPECIAL, train_tokenizer
from vllm_qaic_connector.protocol.ticket import prompt_hash
from vllm_qaic_proxy.first_token import FirstToken, fix_event

EOS = SPECIAL.index("<eos>")


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    path = tmp_path_factory.mktemp(request.param)
    train_tokenizer(path, request.param)
    return get_tokenizer(str(path))


def serve(tokenizer: Any, prompt: list[int], tokens: list[int]) -> tuple[str, list[int], str]:
    """What a vLLM server answers when its model generates ``tokens`` (greedy, up to the
    first EOS): text, token ids, finish reason."""
    request = EngineCoreRequest(
        "r", prompt, None, SamplingParams(max_tokens=len(tokens)), None, 0.0, None, None, None
    )
    detok = IncrementalDetokenizer.from_new_request(tokenizer, request)
    finish = "length"
    for t in tokens:
        detok.update([t], stop_terminated=t == EOS)
        if t == EOS:
            finish = "stop"
            break
    return detok.get_next_output_text(finished=True, delta=False), detok.output_token_ids, finish


def ticket(prompt: list[int]) -> dict[str, Any]:
    return {
        "do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
        "remote_port": 5600, "remote_request_id": "p-1", "num_tokens": len(prompt),
        "staging_offset": 0, "staged_layout": "vllm_cpu_vec", "staged_block_size": 128,
        "incarnation": "feedfacefeedface", "generation": 1 << 32,
        "prompt_hash": prompt_hash(prompt), "lease_s": 60.0, "expires_at": time.time() + 60,
    }  # fmt: skip


def test_the_joined_text_is_the_aggregated_text_or_the_decode_answers_alone(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    joined = declined = naive_wrong = 0
    for _ in range(600):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        # Mostly ordinary tokens, sometimes a special one (EOS ends the answer).
        tokens = [rng.randrange(0, vocab) if rng.random() < 0.1 else rng.randrange(3, vocab)
                  for _ in range(rng.randint(1, 6))]  # fmt: skip
        body = {"prompt": "...", "max_tokens": len(tokens), "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        agg_text, agg_ids, _ = serve(tokenizer, prompt, tokens)
        text, ids, finish = serve(tokenizer, prompt, tokens[:1])
        prefilled = {
            "id": "cmpl-p",
            "choices": [{"index": 0, "text": text, "finish_reason": finish,
                         "prompt_token_ids": prompt, "token_ids": ids}],
            "kv_transfer_params": ticket(prompt),
        }  # fmt: skip
        first = FirstToken.of(prefilled, body)
        if first is None:
            declined += 1  # the decode computes the first token itself: vLLM's own answer
            continue
        if first.finished:
            answer = first.answer["choices"][0]
            assert (answer["text"], answer["token_ids"]) == (agg_text, agg_ids)
            continue
        rest_text, rest_ids, _ = serve(tokenizer, prompt + ids, tokens[1:])
        decoded = {"choices": [{"text": rest_text, "token_ids": rest_ids}], "usage": None}
        choice = first.joined(decoded)["choices"][0]
        assert choice["text"] == agg_text, (prompt, tokens)
        assert choice["token_ids"] == agg_ids and choice["prompt_token_ids"] == prompt
        joined += 1
    for _ in range(600):  # how often a join without the rule would have been wrong
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        tokens = [rng.randrange(3, vocab) for _ in range(4)]
        agg_text = serve(tokenizer, prompt, tokens)[0]
        text = serve(tokenizer, prompt, tokens[:1])[0]
        naive_wrong += text + serve(tokenizer, prompt + tokens[:1], tokens[1:])[0] != agg_text
    print(f"joined {joined}, declined {declined}, a blind join wrong in {naive_wrong} of 600")
    assert joined > 100 and naive_wrong > 10  # both paths ran, and the rule was needed


def vllm_logprobs(tokenizer: Any, tokens: list[int], first_offset: int = 0) -> dict[str, Any]:
    """A completion's logprobs for ``tokens`` as vLLM's API server writes them (its own
    ``_create_completion_logprobs``, 3 top logprobs), each step's seeded from its token."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import Logprob

    server = object.__new__(OpenAIServingCompletion)  # the method reads one setting
    server.return_tokens_as_token_ids = False
    steps = []
    for t in tokens:
        rng = random.Random(t)
        steps.append({t: Logprob(-rng.random()), **{o: Logprob(-1 - rng.random())
                      for o in rng.sample(range(3, len(tokenizer)), 3) if o != t}})  # fmt: skip
    made = server._create_completion_logprobs(tokens, steps, 3, tokenizer,
                                               initial_text_offset=first_offset)  # fmt: skip
    return made.model_dump()


def test_logprobs_joined_from_both_legs_are_vllm_s_for_the_whole_answer(tokenizer):
    """The first token's logprobs are the prefill's (vLLM alone computes them in the prompt's
    pass too), the rest the decode's, whose text offsets count from its own first token:
    joined whole and streamed, the lists are the aggregated server's, offsets included."""
    rng = random.Random(1)
    for _ in range(200):
        prompt = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(1, 20))]
        tokens = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(2, 6))]
        text, ids, finish = serve(tokenizer, prompt, tokens[:1])
        choice = {"index": 0, "text": text, "finish_reason": finish, "prompt_token_ids": prompt,
                  "token_ids": ids, "logprobs": vllm_logprobs(tokenizer, ids)}  # fmt: skip
        prefilled = {"id": "cmpl-p", "choices": [choice], "kv_transfer_params": ticket(prompt)}
        body = {"prompt": "...", "max_tokens": len(tokens), "logprobs": 3}
        first = FirstToken.of(prefilled, body)
        if first is None:
            continue  # the decode's own first token (its text is not whole yet)
        whole = vllm_logprobs(tokenizer, tokens)
        rest = vllm_logprobs(tokenizer, tokens[1:])
        decoded = {"choices": [{"text": "", "logprobs": rest}], "usage": None}
        assert first.joined(decoded)["choices"][0]["logprobs"] == whole
        # Streamed: the decode's events count on from its own first token, one by one.
        head = json.loads(first.events(None)[6:])["choices"][0]["logprobs"]
        streamed, offset = [head], 0
        for t in tokens[1:]:
            step = vllm_logprobs(tokenizer, [t], offset)
            offset = step["text_offset"][-1] + len(step["tokens"][-1])
            line = b"data: " + json.dumps({"choices": [{"logprobs": step}]}).encode()
            streamed.append(json.loads(fix_event(line, first.shift)[6:])["choices"][0]["logprobs"])
        assert {k: [v for s in streamed for v in s[k]] for k in whole} == whole


@pytest.mark.parametrize(
    "extra",
    [{"seed": 7, "temperature": 0.8}, {"spaces_between_special_tokens": False},
     {"return_token_ids": True, "stream": True}],
    ids=["seeded sampler", "no spaces between special tokens", "token ids streamed"],
)  # fmt: skip
def test_state_carried_across_the_first_token_keeps_the_decodes_own(extra):
    from vllm_qaic_proxy.first_token import eligible

    assert eligible({"prompt": "a b c"})
    assert not eligible({"prompt": "a b c", **extra})


# Fields of vLLM's CompletionRequest across which the decode continues exactly from the
# prefill's token (or that the proxy handles itself): each was checked against vLLM's own
# answers (`testbed.proxy_clients.check_answers_match_vllm`, RESULTS.md) or acts per step.
CONTINUES = {
    "model", "prompt", "max_tokens", "n", "stream", "stream_options", "stream_interval",
    "temperature", "top_p", "top_k", "min_p", "seed", "logit_bias", "allowed_token_ids",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens",
    "truncate_prompt_tokens", "truncation_side", "return_token_ids", "cache_salt",
    "kv_transfer_params", "priority", "request_id", "session_id", "user",
}  # fmt: skip


def test_every_field_of_vllm_s_request_is_sorted():
    """A field vLLM adds is either an option that spans the first token or one that
    continues; until it is sorted, this fails. It let repetition_detection through: the
    decode, not seeing the first token as output, ended its answer one token late."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_qaic_proxy.first_token import MERGED, SPANNING

    fields = set(CompletionRequest.model_fields)
    assert not set(SPANNING) & CONTINUES and not set(MERGED) & (CONTINUES | set(SPANNING))
    assert fields - CONTINUES - set(SPANNING) - set(MERGED) == set(), "sort these fields"
