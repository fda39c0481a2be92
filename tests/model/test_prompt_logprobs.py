"""Prompt logprobs (vLLM's `prompt_logprobs`) from both engines' prefill paths equal
transformers' `log_softmax(model(prompt).logits)`, over several prefill chunks and past a
prefix-cache hit the request must not take."""

from __future__ import annotations

import pytest
import torch
from support.oracle import hf_model, make_engine, make_prompts

from pagedserve.errors import InvalidArgument
from pagedserve.model.requests.sequence import Sequence
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.sampling_params import SamplingParams

TOL = 1e-4
CHUNK = 32  # tokens per step: the long prompts take several chunks
LENS = (1, 2, 9, 70)


def hf_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row p is the log-distribution of the token after position p."""
    with torch.no_grad():
        logits = hf_model(model_dir, torch.float32)(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def max_error(model_dir, seq: Sequence, num_top: int) -> float:
    """Check `seq.prompt_logprobs` against transformers (tokens, ranks, top ids); returns the
    largest absolute logprob difference."""
    prompt = seq.prompt_token_ids
    assert len(seq.prompt_logprobs) == len(prompt) - 1
    ref = hf_logprobs(model_dir, prompt)
    worst = 0.0
    for i, entry in enumerate(seq.prompt_logprobs, start=1):
        row = ref[i - 1]
        assert entry.token_id == prompt[i]
        worst = max(worst, abs(entry.logprob - float(row[prompt[i]])))
        value = row[prompt[i]]
        assert int((row > value + TOL).sum()) + 1 <= entry.rank <= int((row >= value - TOL).sum())
        top = torch.topk(row, num_top)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        errors = [abs(lp - v) for (_, lp), v in zip(entry.top, top.values.tolist(), strict=True)]
        worst = max([worst, *errors])
    return worst


def run_prefill(engine: PrefillEngine, prompts, params: SamplingParams) -> list[Sequence]:
    seqs = [engine.new_sequence(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.add_sequence(seq)
    while engine.has_unfinished:
        for seq in engine.step().done:
            engine.free(seq.block_table)
    engine.check_integrity()
    return seqs


def test_prefill_engine_prompt_logprobs_equal_transformers_across_chunks(tiny_llama):
    config = PrefillEngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=CHUNK,
                                 use_shm=False)  # fmt: skip
    engine = PrefillEngine.from_model_dir(str(tiny_llama), config)
    prompts = make_prompts(LENS, seed=5)
    # NOTE: the same prompts once without: their full blocks are now in the prefix cache
    plain = run_prefill(engine, prompts, SamplingParams(temperature=0.0, max_tokens=1))
    assert plain[-1].prompt_logprobs == []
    again = run_prefill(engine, prompts, SamplingParams(temperature=0.0, max_tokens=1))
    assert again[-1].num_cached_prompt_tokens == 64  # the cache works: a hit without them

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    seqs = run_prefill(engine, prompts, params)
    assert [s.num_cached_prompt_tokens for s in seqs] == [0] * len(LENS)  # no hit taken
    worst = max(max_error(tiny_llama, seq, 5) for seq in seqs)
    assert worst < TOL
    print(f"prefill engine: max |logprob - transformers| = {worst:.2e}")
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in plain]


def test_decode_engine_prefill_computes_prompt_logprobs_once(tiny_llama):
    engine = make_engine(tiny_llama, block_size=16, num_blocks=64, max_num_batched_tokens=CHUNK)
    prompts = make_prompts(LENS, seed=6)
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))  # fills the cache
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0)
    seqs = engine.generate(prompts, params)
    engine.check_integrity()
    assert [s.num_cached_prompt_tokens for s in seqs] == [0] * len(LENS)
    assert max(max_error(tiny_llama, seq, 0) for seq in seqs) < TOL
    assert all(entry.top == [] for seq in seqs for entry in seq.prompt_logprobs)


def test_prompt_logprobs_are_validated_like_logprobs():
    with pytest.raises(InvalidArgument) as exc:
        SamplingParams(prompt_logprobs=21).validate()
    assert exc.value.field == "prompt_logprobs"
    with pytest.raises(InvalidArgument) as exc:
        SamplingParams(temperature=0.0, use_beam_search=True, n=2, prompt_logprobs=1).validate()
    assert exc.value.field == "prompt_logprobs"
