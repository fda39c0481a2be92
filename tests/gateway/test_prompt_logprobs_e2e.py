"""Prompt logprobs for evaluation harnesses through the OpenAI API: the official `openai` SDK
sends lm-eval's loglikelihood request (`echo`, `logprobs: 1`, `max_tokens: 1`, temperature 0,
token-id prompts in a batch) to a real `pagedserve up --http-port` cluster of the tiny chat model
(the one tests/gateway/test_structured_e2e.py and the examples share); the echoed prompt's
logprobs equal transformers' `log_softmax(model(prompt).logits)` (fp32)."""

from __future__ import annotations

import grpc
import openai
import pytest
import torch
from support.oracle import hf_model, make_prompts
from transformers import AutoTokenizer

from pagedserve.client import Client
from pagedserve.sampling_params import SamplingParams

TOL = 1e-4


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> tuple[list[float], list[int]]:
    """transformers' logprob of each prompt token after the first, and the argmax before it."""
    with torch.no_grad():
        logits = hf_model(model_dir, torch.float32)(torch.tensor([prompt])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values = [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    return values, logprobs[:-1].argmax(-1).tolist()


def lm_eval_request(client, model: str, prompts: list[list[int]]):
    """lm-eval's `local-completions` loglikelihood payload, as its `_create_payload` builds it."""
    return client.completions.create(
        model=model, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234,
        echo=True,
    )  # fmt: skip


def test_lm_eval_loglikelihood_request_returns_exact_prompt_logprobs(client, model, cluster):
    model_dir = cluster[1]
    prompts = make_prompts((5, 40), seed=81)  # NOTE: a batch of two, as lm-eval sends
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answer = lm_eval_request(client, model, prompts)
    assert [c.index for c in answer.choices] == [0, 1]
    worst = 0.0
    for prompt, choice in zip(prompts, answer.choices, strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(prompt) + 1  # + the generated one
        assert len(lp.top_logprobs) == len(lp.text_offset) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want, argmax = hf_prompt_logprobs(model_dir, prompt)
        got = lp.token_logprobs[1 : len(prompt)]
        worst = max(worst, *(abs(g - w) for g, w in zip(got, want, strict=True)))
        # lm-eval's parse_logprobs: the continuation's sum and whether it is greedy
        for i, top in enumerate(lp.top_logprobs[1 : len(prompt)], start=1):
            assert len(top) == 1
            greedy = lp.token_logprobs[i] == max(top.values())
            assert greedy == (argmax[i - 1] == prompt[i])
        assert choice.text.startswith(tokenizer.decode(prompt))
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
    print(f"gateway: max |token_logprob - transformers| = {worst:.2e}")
    assert worst < TOL


def test_echo_survives_the_prefix_cache_and_max_tokens_zero(client, model):
    prompt = make_prompts((48,), seed=82)[0]
    first = lm_eval_request(client, model, [prompt]).choices[0]
    again = client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=0, logprobs=2, echo=True
    )
    choice = again.choices[0]
    # NOTE: the second request's prompt blocks are cached: it must not take the hit
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs == first.logprobs.token_logprobs[: len(prompt)]
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    assert choice.text == first.text[: len(choice.text)]
    assert choice.finish_reason == "length"


def test_echo_of_text_prompts_streamed_and_not(client, model):
    prompts = ["Hello there", "The quick brown fox"]
    whole = client.completions.create(model=model, prompt=prompts, max_tokens=3,
                                      temperature=0, echo=True)  # fmt: skip
    for prompt, choice in zip(prompts, whole.choices, strict=True):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        assert choice.logprobs is None
    stream = client.completions.create(
        model=model, prompt=prompts[0], max_tokens=3, temperature=0, echo=True, logprobs=0,
        stream=True,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == whole.choices[0].text
    token_logprobs = [x for c in chunks if c.choices[0].logprobs
                      for x in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert token_logprobs[0] is None and all(x is not None for x in token_logprobs[1:])


def test_too_many_prompt_logprobs_are_refused_naming_the_field(client, model, cluster):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="Hi", max_tokens=1, logprobs=21, echo=True)
    assert exc.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="Hi", max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"
    with Client(cluster[0].router_address) as grpc_client, pytest.raises(grpc.RpcError) as err:
        list(grpc_client.generate([5, 6, 7], SamplingParams(prompt_logprobs=21), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.prompt_logprobs" in err.value.details()
