"""Incremental detokenization: deltas concatenate to the full decode, never split a character,
and stop strings cut the text exactly."""

from __future__ import annotations

import random

import pytest

from pagedserve.router.detokenizer import Detokenizer
from pagedserve.router.tokenizer import RouterTokenizer

TEXT = "The café serves naïve crème brûlée 🙂 at 日本語 noon.\n\nThen: done!"


@pytest.fixture(scope="module")
def tokenizer(make_tiny):
    return RouterTokenizer.from_model_dir(make_tiny("llama"))


def test_deltas_concatenate_to_the_full_decode_and_never_break_utf8(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = Detokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas), "multi-byte characters span tokens here"


def test_random_token_streams_match_the_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))]
        detok = Detokenizer(tokenizer)
        out = ""
        i = 0
        while i < len(ids):
            step = rng.randrange(1, 4)
            out += detok.add(ids[i : i + step])
            i += step
        out += detok.flush()
        assert out == tokenizer.decode(ids)


def test_special_tokens_are_skipped_or_kept_on_request(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=True)  # starts with <s>
    skip, keep = Detokenizer(tokenizer), Detokenizer(tokenizer, skip_special_tokens=False)
    assert skip.add(ids) + skip.flush() == "hi"
    assert keep.add(ids) + keep.flush() == "<s>hi"


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stop_string_spanning_tokens_cuts_the_output_before_it(tokenizer, chunk):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = Detokenizer(tokenizer, stop=("noon", "never"))
    out = ""
    for i in range(0, len(ids), chunk):
        out += detok.add(ids[i : i + chunk])
        if detok.matched_stop:
            break
    out += detok.flush()
    assert detok.matched_stop == "noon"
    assert out == TEXT[: TEXT.index("noon")]
    assert detok.add(ids[:3]) == "", "nothing after a stop"


def test_held_back_text_is_released_when_no_stop_comes(tokenizer):
    ids = tokenizer.encode("abcdef", add_special_tokens=False)
    detok = Detokenizer(tokenizer, stop=("xyz",))
    streamed = detok.add(ids)
    assert streamed == "abcd", "the last len(stop) - 1 characters wait"
    assert streamed + detok.flush() == "abcdef" and detok.matched_stop is None
