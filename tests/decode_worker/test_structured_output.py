"""Structured output in the DecodeEngine (model/grammar.py on xgrammar) with the tiny Llama:
every grammar kind holds for greedy and sampled requests, for each of n samples, across swap
and recompute preemption and for a stream moved to another worker; a grammar xgrammar cannot
compile is refused by name; logit_bias and allowed_token_ids steer the tokens.

The tiny model's weights are random: what it says does not matter here, only that the grammar
holds (tests/realmodel compares the unconstrained parts with transformers on SmolLM2)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.plan import PreemptionMode
from pagedserve.decode_worker.speculation import SpeculativeConfig
from pagedserve.errors import InvalidArgument
from pagedserve.model.requests.sequence import FinishReason, Sequence
from pagedserve.sampling_params import SamplingParams, StructuredOutput

BLOCK_SIZE = 4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,6}-\d{1,3}"
CHOICES = ("yes", "no", "maybe so")
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
GRAMMARS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "json": StructuredOutput("json"),
    "regex": StructuredOutput("regex", REGEX),
    "choice": StructuredOutput("choice", choices=CHOICES),
    "grammar": StructuredOutput("grammar", GRAMMAR),
}


def follows(kind: str, text: str) -> bool:
    """Whether `text` (the whole output, EOS left out) is what grammar `kind` allows."""
    if kind == "json_schema":
        value = json.loads(text)
        return (
            set(value) == {"name", "age", "kind"}
            and re.fullmatch("[a-z]{1,8}", value["name"]) is not None
            and 0 <= value["age"] <= 30
            and value["kind"] in ("cat", "dog")
        )
    if kind == "json":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([0-9x](,[0-9x])*\)", text) is not None


@pytest.fixture(scope="module")
def model_dir(make_tiny) -> Path:
    return make_tiny("llama")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(model_dir: Path, **overrides) -> DecodeEngine:
    settings: dict = {
        "block_size": BLOCK_SIZE,
        "num_blocks": 400,
        "num_swap_blocks": 0,
        "max_num_batched_tokens": 128,
        "max_num_seqs": 16,
        "measure_costs": False,
    }
    settings.update(overrides)
    return DecodeEngine.from_model_dir(str(model_dir), DecodeEngineConfig(**settings))


def prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (5 + 7 * i,), generator=g).tolist() for i in range(count)]


def text_of(tokenizer, seq: Sequence) -> str:
    return tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)


def run(engine: DecodeEngine, seqs: list[Sequence]) -> None:
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    engine.close()
    assert engine.pool.num_used == 0
    assert engine.runner.sampler.grammars.num_matchers == 0, "a finished request keeps no matcher"


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_every_grammar_kind_holds_for_greedy_and_sampled_requests(model_dir, tokenizer, kind):
    engine = make_engine(model_dir)
    grammar = GRAMMARS[kind]
    # json: any object; a random model's greedy run may fill it to max_tokens, so sampled only
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=96) for s in range(6)]
    if kind != "json":
        params.append(SamplingParams(temperature=0.0, max_tokens=96))
    seqs = [engine.add_request(p, dataclasses.replace(q, structured_output=grammar))
            for p, q in zip(prompts(len(params)), params, strict=True)]  # fmt: skip
    run(engine, seqs)
    finished = [s for s in seqs if s.finish_reason is FinishReason.STOP]
    # NOTE: how many close their JSON object inside max_tokens is the random model's luck (3
    # or 5 of these 6 seeds, depending on how the sampler draws); what the grammar owes is
    # that each one that ends is valid
    need = len(seqs) // 2 if kind == "json" else len(seqs) - 1
    assert len(finished) >= need, [text_of(tokenizer, s) for s in seqs]
    for seq in finished:
        assert follows(kind, text_of(tokenizer, seq)), text_of(tokenizer, seq)


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_speculation_checks_proposals_against_the_grammar(model_dir, tokenizer, kind):
    """With n-gram speculation every verified position is masked by the grammar: greedy tokens
    equal the run without speculation, seeded sampled outputs still follow the grammar, and
    proposals were made (not for `choice`: its answers are too short for anything to recur) and,
    for the JSON schema's repeated keys, accepted."""
    grammar = GRAMMARS[kind]
    params = [SamplingParams(temperature=0.7, seed=s, max_tokens=48, structured_output=grammar)
              for s in range(3)]  # fmt: skip
    if kind != "json":
        params.append(SamplingParams(temperature=0.0, max_tokens=48, structured_output=grammar))
    runs = []
    for speculative in (None, SpeculativeConfig(num_tokens=4)):
        engine = make_engine(model_dir, speculative=speculative)
        seqs = [engine.add_request(p, q) for p, q in zip(prompts(len(params)), params, strict=True)]
        stats = engine.speculation_stats
        run(engine, seqs)
        runs.append(seqs)
    print(f"{kind}: {stats}")
    assert stats is not None and (stats.num_draft_tokens > 0 or kind == "choice")
    assert stats.num_accepted_tokens > 0 or kind != "json_schema"
    off, on = runs
    if kind != "json":
        assert on[-1].output_token_ids == off[-1].output_token_ids
    for seq in on:
        if seq.finish_reason is FinishReason.STOP:
            assert follows(kind, text_of(tokenizer, seq)), text_of(tokenizer, seq)


def test_without_the_grammar_the_same_requests_do_not_follow_it(model_dir, tokenizer):
    """The check above can fail: unconstrained, these requests break the regex."""
    engine = make_engine(model_dir)
    seqs = [engine.add_request(p, SamplingParams(temperature=1.0, seed=s, max_tokens=24))
            for s, p in enumerate(prompts(6))]  # fmt: skip
    run(engine, seqs)
    assert not any(follows("regex", text_of(tokenizer, s)) for s in seqs)


def test_each_of_n_samples_follows_the_grammar(model_dir, tokenizer):
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=32,
                            structured_output=GRAMMARS["choice"])  # fmt: skip
    seq = engine.add_request(prompts(1)[0], params)
    run(engine, [seq])
    assert seq.group is not None
    texts = [text_of(tokenizer, s) for s in seq.group.members]
    assert len(texts) == 4 and all(t in CHOICES for t in texts), texts


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_constrained_greedy_output_survives_preemption(model_dir, tokenizer, mode):
    """A pool too small for every request at once: requests are swapped out (or recomputed) and
    back; each one's grammar state follows it, so its greedy tokens are those of a roomy run."""
    letters = StructuredOutput("regex", "[a-z]{40}")  # NOTE: long outputs: their blocks grow
    params = SamplingParams(temperature=0.0, max_tokens=48, structured_output=letters)
    work = prompts(10)

    def outputs(**pressure) -> tuple[list[list[int]], DecodeEngine]:
        engine = make_engine(model_dir, **pressure)
        seqs = [engine.add_request(p, params) for p in work]
        run(engine, seqs)
        return [s.output_token_ids for s in seqs], engine

    roomy, _ = outputs()
    tight, engine = outputs(num_blocks=100, num_swap_blocks=64, max_num_batched_tokens=64,
                            preemption_mode=mode)  # fmt: skip
    assert engine.stats.num_preemptions > 0
    if mode is PreemptionMode.SWAP:
        assert engine.stats.num_preemptions_swap > 0
    assert tight == roomy
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tight]
    assert all(re.fullmatch("[a-z]{40}", t) for t in texts), texts


def test_a_moved_stream_replays_its_tokens_into_the_grammar(model_dir):
    """The router moves a stream by sending prompt + the tokens already sent, with
    `resumed_tokens`: the new worker's grammar takes up where the old one was."""
    engine = make_engine(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_output=GRAMMARS["grammar"])
    prompt = prompts(1)[0]
    [whole] = engine.generate([prompt], params)
    assert len(whole.output_token_ids) > 4
    sent = whole.output_token_ids[:3]
    grammar = dataclasses.replace(GRAMMARS["grammar"], resumed_tokens=len(sent))
    moved = dataclasses.replace(params, max_tokens=40 - len(sent), structured_output=grammar)
    [rest] = engine.generate([prompt + sent], moved)
    assert sent + rest.output_token_ids == whole.output_token_ids
    engine.check_integrity()


def test_a_grammar_xgrammar_cannot_compile_is_refused_by_name_and_holds_nothing(model_dir):
    engine = make_engine(model_dir)
    bad = [
        StructuredOutput("grammar", "root ::= undefined_rule"),
        StructuredOutput("json_schema", '{"type": "no-such-type"}'),
    ]
    for grammar in bad:
        with pytest.raises(InvalidArgument) as info:
            engine.add_request([1, 2, 3], SamplingParams(structured_output=grammar))
        assert info.value.field == grammar.field
    assert engine.pool.num_used == 0 and not engine.has_unfinished
    engine.check_integrity()


def test_logit_bias_allowed_token_ids_and_bad_words_steer_greedy_tokens(model_dir):
    engine = make_engine(model_dir)
    prompt = prompts(1)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    [plain] = engine.generate([prompt], greedy)
    first, second = plain.output_token_ids[:2]
    [without] = engine.generate([prompt], dataclasses.replace(greedy, bad_word_ids=((first,),)))
    assert first not in without.output_token_ids
    pair = dataclasses.replace(greedy, bad_word_ids=((first, second),))
    [steered] = engine.generate([prompt], pair)
    assert steered.output_token_ids[0] == first and steered.output_token_ids[1] != second
    [banned] = engine.generate([prompt], dataclasses.replace(greedy, logit_bias=((first, -100.0),)))
    assert banned.output_token_ids[0] != first
    [forced] = engine.generate([prompt], dataclasses.replace(greedy, logit_bias=((77, 100.0),)))
    assert forced.output_token_ids == [77] * 8
    allowed = (40, 41, 42)
    [few] = engine.generate([prompt], dataclasses.replace(greedy, allowed_token_ids=allowed))
    assert set(few.output_token_ids) <= set(allowed) and len(few.output_token_ids) == 8
    engine.check_integrity()
