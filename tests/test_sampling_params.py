"""SamplingParams: vLLM defaults, the greedy rule, and one test per validation rule."""

from __future__ import annotations

import dataclasses
import math
import pickle
import subprocess
import sys

import pytest

from pagedserve.errors import InvalidArgument, ResourceExhausted
from pagedserve.sampling_params import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    SamplingParams,
    StructuredOutput,
    sample_seed,
)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ((), (), False)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.logprobs, p.skip_special_tokens) == (None, True)
    p.validate(vocab_size=32, max_model_len=64, prompt_len=48)


def test_params_are_frozen_and_hashable() -> None:
    p = SamplingParams(stop=("a",), stop_token_ids=(1, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop=("a",), stop_token_ids=(1, 2)))


@pytest.mark.parametrize(
    ("params", "greedy"),
    [
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(temperature=1e-6), True),
        (SamplingParams(temperature=0.7, top_k=1), True),
        (SamplingParams(temperature=0.7), False),
        (SamplingParams(temperature=1.0, top_k=2), False),
        (SamplingParams(temperature=1.0, top_k=-1), False),
    ],
)
def test_greedy_is_zero_temperature_or_top_k_one(params: SamplingParams, greedy: bool) -> None:
    assert params.greedy is greedy


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0),
        SamplingParams(top_p=1e-9, top_k=5, min_p=0.0, seed=0),
        SamplingParams(seed=2**63 - 1, max_tokens=1, min_tokens=1),
        SamplingParams(repetition_penalty=1e-3, presence_penalty=-2.0, frequency_penalty=2.0),
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=MAX_LOGPROBS),
        SamplingParams(stop=("x" * MAX_STOP_STRING_LEN,) * MAX_STOP_STRINGS),
        SamplingParams(stop_token_ids=(0, 31)),
    ],
)
def test_boundary_values_are_valid(params: SamplingParams) -> None:
    params.validate(vocab_size=32)


G = StructuredOutput
J = StructuredOutput("json")

INVALID = [
    ("temperature", SamplingParams(temperature=-0.1)),
    ("temperature", SamplingParams(temperature=math.inf)),
    ("temperature", SamplingParams(temperature=math.nan)),
    ("top_p", SamplingParams(top_p=0.0)),
    ("top_p", SamplingParams(top_p=1.01)),
    ("top_p", SamplingParams(top_p=math.nan)),
    ("top_k", SamplingParams(top_k=-2)),
    ("min_p", SamplingParams(min_p=-0.01)),
    ("min_p", SamplingParams(min_p=1.01)),
    ("min_p", SamplingParams(min_p=math.nan)),
    ("seed", SamplingParams(seed=-1)),
    ("seed", SamplingParams(seed=2**63)),
    ("max_tokens", SamplingParams(max_tokens=0)),
    ("min_tokens", SamplingParams(min_tokens=-1)),
    ("min_tokens", SamplingParams(max_tokens=4, min_tokens=5)),
    ("repetition_penalty", SamplingParams(repetition_penalty=0.0)),
    ("repetition_penalty", SamplingParams(repetition_penalty=-1.0)),
    ("repetition_penalty", SamplingParams(repetition_penalty=math.inf)),
    ("presence_penalty", SamplingParams(presence_penalty=2.01)),
    ("presence_penalty", SamplingParams(presence_penalty=-2.01)),
    ("frequency_penalty", SamplingParams(frequency_penalty=2.01)),
    ("frequency_penalty", SamplingParams(frequency_penalty=math.nan)),
    ("logprobs", SamplingParams(logprobs=-1)),
    ("logprobs", SamplingParams(logprobs=MAX_LOGPROBS + 1)),
    ("stop", SamplingParams(stop=("s",) * (MAX_STOP_STRINGS + 1))),
    ("stop", SamplingParams(stop=("ok", ""))),
    ("stop", SamplingParams(stop=("x" * (MAX_STOP_STRING_LEN + 1),))),
    ("stop", SamplingParams(stop="abc")),  # type: ignore[arg-type]
    ("stop_token_ids", SamplingParams(stop_token_ids=(3, 32))),
    ("stop_token_ids", SamplingParams(stop_token_ids=(-1,))),
    ("logit_bias", SamplingParams(logit_bias=((32, 1.0),))),
    ("logit_bias", SamplingParams(logit_bias=((3, 100.5),))),
    ("logit_bias", SamplingParams(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)))),
    ("allowed_token_ids", SamplingParams(allowed_token_ids=(1, 32))),
    ("bad_words", SamplingParams(bad_words=("",))),
    ("bad_words", SamplingParams(bad_words=("w",) * 65)),
    ("bad_word_ids", SamplingParams(bad_word_ids=((1, 32),))),
    ("bad_word_ids", SamplingParams(bad_word_ids=((),))),
    ("structured_output.json_schema", SamplingParams(structured_output=G("json_schema", "{x"))),
    ("structured_output.json_schema", SamplingParams(structured_output=G("json_schema", "[1]"))),
    ("structured_output.regex", SamplingParams(structured_output=G("regex", "(a"))),
    ("structured_output.regex", SamplingParams(structured_output=G("regex", ""))),
    ("structured_output.choice", SamplingParams(structured_output=G("choice"))),
    ("structured_output.choice", SamplingParams(structured_output=G("choice", choices=("a", "")))),
    ("structured_output.grammar", SamplingParams(structured_output=G("grammar", " "))),
    ("structured_output.grammar",
     SamplingParams(structured_output=G("grammar", "x" * (MAX_GRAMMAR_CHARS + 1)))),
    ("use_beam_search", SamplingParams(temperature=0, use_beam_search=True, structured_output=J)),
    ("ignore_eos", SamplingParams(ignore_eos=True, structured_output=J)),
    ("min_tokens", SamplingParams(min_tokens=1, structured_output=J)),
    ("allowed_token_ids", SamplingParams(allowed_token_ids=(1,), structured_output=J)),
]  # fmt: skip


@pytest.mark.parametrize(("field", "params"), INVALID, ids=[f for f, _ in INVALID])
def test_invalid_field_is_named(field: str, params: SamplingParams) -> None:
    with pytest.raises(InvalidArgument) as info:
        params.validate(vocab_size=32)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_negative_stop_token_id_is_rejected_without_vocab_size() -> None:
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(stop_token_ids=(-5,)).validate()
    assert info.value.field == "stop_token_ids"


def test_stop_token_ids_beyond_vocab_pass_when_vocab_size_is_unknown() -> None:
    SamplingParams(stop_token_ids=(10**6,)).validate()


def test_prompt_plus_max_tokens_must_fit_the_model() -> None:
    SamplingParams(max_tokens=16).validate(max_model_len=64, prompt_len=48)
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(max_tokens=17).validate(max_model_len=64, prompt_len=48)
    assert info.value.field == "max_tokens"
    assert "48" in info.value.description and "64" in info.value.description


def test_length_check_needs_both_max_model_len_and_prompt_len() -> None:
    SamplingParams(max_tokens=1000).validate(max_model_len=64)
    SamplingParams(max_tokens=1000).validate(prompt_len=63)


def test_validate_reports_the_bad_value() -> None:
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(top_p=1.5).validate()
    assert "1.5" in info.value.description


def test_invalid_argument_is_a_value_error_with_prefixable_field() -> None:
    err = InvalidArgument("top_p", "must be in (0, 1], got 2")
    assert isinstance(err, ValueError)
    assert str(err) == "top_p: must be in (0, 1], got 2"
    nested = err.with_prefix("sampling_params")
    assert (nested.field, nested.description) == ("sampling_params.top_p", err.description)


def test_errors_survive_pickling() -> None:
    err = pickle.loads(pickle.dumps(InvalidArgument("seed", "bad")))
    assert (err.field, err.description) == ("seed", "bad")
    busy = pickle.loads(pickle.dumps(ResourceExhausted("queue full", retry_after_s=0.5)))
    assert (str(busy), busy.retry_after_s) == ("queue full", 0.5)


def test_module_stays_torch_free() -> None:
    code = (
        "import sys, pagedserve.sampling_params, pagedserve.errors; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(n=0), "n"),
        (SamplingParams(n=3, best_of=2), "best_of"),
        (SamplingParams(n=9), "n"),
        (SamplingParams(n=2, best_of=9), "best_of"),
        (SamplingParams(use_beam_search=True, temperature=0.5), "temperature"),
        (SamplingParams(use_beam_search=True, temperature=0.0, n=3, beam_width=2), "n"),
        (SamplingParams(use_beam_search=True, temperature=0.0, beam_width=9), "beam_width"),
        (SamplingParams(use_beam_search=True, temperature=0.0, best_of=2), "best_of"),
        (SamplingParams(use_beam_search=True, temperature=0.0, stop=("a",)), "stop"),
        (SamplingParams(use_beam_search=True, temperature=0.0, logprobs=0), "logprobs"),
        (SamplingParams(use_beam_search=True, temperature=0.0, min_tokens=1), "min_tokens"),
        (SamplingParams(use_beam_search=True, temperature=0.0, repetition_penalty=1.2),
         "repetition_penalty"),
        (SamplingParams(beam_width=2), "beam_width"),
        (SamplingParams(length_penalty=0.5), "length_penalty"),
    ],
)  # fmt: skip
def test_bad_sample_counts_and_beam_searches_name_the_field(params, field) -> None:
    with pytest.raises(InvalidArgument) as err:
        params.validate(max_n=8)
    assert err.value.field == field


def test_sample_counts_seeds_and_beams() -> None:
    assert SamplingParams(n=3).num_samples == 3
    assert SamplingParams(n=2, best_of=5).num_samples == 5
    beam = SamplingParams(temperature=0.0, use_beam_search=True, beam_width=4, n=2)
    beam.validate(max_n=4)
    assert (beam.num_samples, beam.num_outputs) == (4, 2)
    seeded = SamplingParams(seed=7, n=3)
    assert seeded.for_sample(0) is seeded
    assert [seeded.for_sample(i).seed for i in range(3)] == [sample_seed(7, i) for i in range(3)]
    assert len({sample_seed(7, i) for i in range(64)}) == 64
    assert all(0 <= sample_seed(2**63 - 1, i) < 2**63 for i in range(8))
    assert SamplingParams(n=3).for_sample(2).seed is None
