"""Structured output on the real model (SmolLM2-135M-Instruct, in-process DecodeEngine):

- where the grammar allows what the model would say anyway, the greedy tokens are transformers'
  `generate(do_sample=False)`, token for token (the mask never moves an allowed argmax);
- where it does not, the answer follows it and is still the model's own: a JSON schema answer
  parses and validates, and its first tokens are the model's most likely allowed ones.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.sampling_params import SamplingParams, StructuredOutput

NEW_TOKENS = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    config = DecodeEngineConfig(block_size=16, num_blocks=64, num_swap_blocks=0)
    engine = DecodeEngine.from_model_dir(str(smollm2_dir), config)
    yield engine
    engine.check_integrity()
    engine.close()


def chat_prompt(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_grammar_that_allows_the_answer_leaves_transformers_greedy_tokens(
    smollm2_dir, tokenizer, engine
):
    prompt = chat_prompt(tokenizer, QUESTION)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    want = out[0, len(prompt) :].tolist()
    anything = StructuredOutput("regex", r"[\s\S]*")  # any text: the mask only drops bad UTF-8
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, structured_output=anything)
    [seq] = engine.generate([prompt], params)
    assert seq.output_token_ids == want, tokenizer.decode(seq.output_token_ids)
    # and one that disallows the model's own answer changes it: the check can fail
    digits = StructuredOutput("regex", "[0-9]+")
    [other] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                       structured_output=digits))  # fmt: skip
    assert other.output_token_ids != want[:8]
    assert tokenizer.decode(other.output_token_ids, skip_special_tokens=True).isdigit()


def test_a_json_schema_answer_validates_and_says_paris(tokenizer, engine):
    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Reply in JSON with the country France and its "
                 "capital city."}]  # fmt: skip
    grammar = StructuredOutput("json_schema", json.dumps(schema))
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_output=grammar)
    [seq] = engine.generate([chat_prompt(tokenizer, messages)], params)
    answer = json.loads(tokenizer.decode(seq.output_token_ids, skip_special_tokens=True))
    assert set(answer) == {"country", "capital"}
    assert "Paris" in answer["capital"], answer
