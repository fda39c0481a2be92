"""Structured output and logits controls through the OpenAI API: the official `openai` SDK against
a real `pagedserve up --http-port` cluster (redis-server, router, prefill and decode worker
processes, gateway) of the tiny chat model, the one tests/router/test_chat_e2e.py and the
examples share. The tiny model's weights are random, so what holds is the grammar's doing."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field, ValidationError
from transformers import AutoTokenizer

MESSAGES = [{"role": "user", "content": "Describe a pet."}]
SEEDS = range(20)


class Pet(BaseModel):
    name: str = Field(pattern="^[a-z]{1,8}$")
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog"]


def is_pet(text: str | None) -> bool:
    try:
        Pet.model_validate_json(text or "")
    except ValidationError:
        return False
    return True


def test_parse_with_a_pydantic_model_validates_for_every_seeded_sample(client, model):
    for seed in SEEDS:
        completion = client.chat.completions.parse(
            model=model, messages=MESSAGES, response_format=Pet, temperature=1.0, seed=seed,
            max_tokens=64,
        )  # fmt: skip
        message = completion.choices[0].message
        assert isinstance(message.parsed, Pet), message.content
        assert completion.choices[0].finish_reason == "stop"
    # the check can fail: the same requests without the schema are no Pet
    plain = [
        client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=64
        )
        .choices[0]
        .message.content
        for seed in SEEDS[:5]
    ]
    assert not any(is_pet(text) for text in plain), plain


def test_regex_and_choice_hold_on_every_one_of_n_samples(client, model):
    regex = client.completions.create(
        model=model, prompt="Code:", n=4, temperature=1.0, seed=1, max_tokens=32,
        extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2,4}"},
    )  # fmt: skip
    texts = [c.text for c in regex.choices]
    assert len(texts) == 4 and all(re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", t) for t in texts), texts
    choice = client.chat.completions.create(
        model=model, messages=MESSAGES, n=4, temperature=1.0, seed=2, max_tokens=16,
        extra_body={"structured_outputs": {"choice": ["cat", "dog", "parrot"]}},
    )  # fmt: skip
    answers = [c.message.content for c in choice.choices]
    assert len(answers) == 4 and set(answers) <= {"cat", "dog", "parrot"}, answers


def test_a_streamed_json_schema_answer_is_the_unstreamed_one(client, model):
    pet = {"name": "pet", "strict": True, "schema": Pet.model_json_schema()}
    schema = {"type": "json_schema", "json_schema": pet}
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0.0, max_tokens=64, response_format=schema
    )
    text = whole.choices[0].message.content
    assert is_pet(text), text
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0.0, max_tokens=64, response_format=schema,
        stream=True,
    )  # fmt: skip
    parts = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(parts) == text and len(parts) > 2


def test_json_object_mode_answers_a_json_object(client, model):
    for seed in range(3):
        answer = client.chat.completions.create(
            model=model, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=128,
            response_format={"type": "json_object"},
        )  # fmt: skip
        if answer.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),  # xgrammar's refusal
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                     "schema": {"type": "no"}}}},
         "response_format"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_parameter(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, extra_body=extra
        )
    assert info.value.body["param"] == param, info.value.body


def test_logit_bias_and_allowed_token_ids_steer_the_answer(client, model, cluster):
    tokenizer = AutoTokenizer.from_pretrained(cluster[1])
    token = tokenizer.convert_tokens_to_ids("dd")
    forced = client.completions.create(
        model=model, prompt="Say:", temperature=0.0, max_tokens=5, logit_bias={str(token): 100}
    )
    assert forced.choices[0].text == tokenizer.decode([token] * 5)
    plain = client.completions.create(model=model, prompt="Say:", temperature=0.0, max_tokens=5)
    allowed = client.completions.create(
        model=model, prompt="Say:", temperature=0.0, max_tokens=5,
        extra_body={"allowed_token_ids": [token]},
    )  # fmt: skip
    assert allowed.choices[0].text == forced.choices[0].text != plain.choices[0].text


def test_bad_words_win_over_a_bias_toward_them(client, model, cluster):
    tokenizer = AutoTokenizer.from_pretrained(cluster[1])
    token = tokenizer.convert_tokens_to_ids("dd")
    body = dict(model=model, prompt="Say:", temperature=0.0, max_tokens=5)
    forced = client.completions.create(**body, logit_bias={str(token): 100})
    assert forced.choices[0].text == "dd" * 5
    banned = client.completions.create(
        **body, logit_bias={str(token): 100}, extra_body={"bad_words": ["dd"]}
    )
    assert "dd" not in banned.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body, extra_body={"bad_words": ["x" * 300]})
    assert info.value.body["param"] == "bad_words"
