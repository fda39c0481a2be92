"""The router's side of structured output and logits controls: bad words become token
sequences; a moved stream's grammar replays the tokens already
sent (`resumed_tokens`), and a field a worker names (a grammar only the workers can compile)
reaches the client under the GenerateRequest path."""

from __future__ import annotations

from pagedserve.router.convert import RouterRequest, bad_word_ids, continuation
from pagedserve.router.servicer import request_field
from pagedserve.router.tokenizer import RouterTokenizer
from pagedserve.sampling_params import SamplingParams, StructuredOutput


def request(prompt: list[int], params: SamplingParams) -> RouterRequest:
    return RouterRequest(request_id="r", prompt_token_ids=prompt, params=params, priority=0,
                         cache_salt="", stream=True)  # fmt: skip


def test_a_moved_stream_replays_what_it_sent_into_its_grammar():
    grammar = StructuredOutput("regex", "[a-z]+")
    original = request([1, 2, 3], SamplingParams(max_tokens=10, structured_output=grammar))
    moved = continuation(original, [7, 8])
    assert moved.prompt_token_ids == [1, 2, 3, 7, 8]
    assert moved.params.structured_output == StructuredOutput("regex", "[a-z]+", resumed_tokens=2)
    assert moved.params.max_tokens == 8
    # a second move starts again from the original request, with every token sent so far
    again = continuation(original, [7, 8, 9])
    assert again.params.structured_output.resumed_tokens == 3
    plain = continuation(request([1], SamplingParams()), [4])
    assert plain.params.structured_output is None


def test_worker_fields_get_their_request_path():
    assert request_field("structured_output.grammar") == "sampling.structured_output.grammar"
    assert request_field("logit_bias") == "sampling.logit_bias"
    assert request_field("prompt_token_ids") == "prompt_token_ids"


def test_bad_words_become_their_token_sequences_with_and_without_a_space(tiny_llama):
    tokenizer = RouterTokenizer.from_model_dir(tiny_llama)
    params = SamplingParams(bad_words=("hello", " world"), bad_word_ids=((9,),))
    got = bad_word_ids(params, tokenizer)
    want = [(9,)]
    for word in ("hello", "world"):
        for text in (word, " " + word):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids not in want:
                want.append(ids)
    assert got == tuple(want) and len(got) >= 3
    too_many = SamplingParams(bad_words=("x",) * 65)
    assert bad_word_ids(too_many, tokenizer) == ()  # left to validate, which names the field
