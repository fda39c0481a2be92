"""The runtime against its oracle: Hugging Face transformers' greedy `generate()`, token for token.

Every test here runs pagedserve's decode engine in-process (paged KV cache, flattened mixed
batches, no gRPC) and compares
with transformers on the same weights, one prompt at a time (no padding on the oracle side).
"""

from __future__ import annotations

import pytest
import torch
from support.oracle import GREEDY, hf_greedy, make_engine, make_prompts, run_engine


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "phi3"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_fp32_greedy_tokens_and_logits_match_transformers(make_tiny, arch, block_size):
    model_dir = make_tiny(arch)
    prompts = make_prompts()
    num_blocks = 1200 if block_size == 1 else 1200 // block_size + 16
    engine, seqs = run_engine(
        model_dir, prompts, record_logits=True, block_size=block_size, num_blocks=num_blocks
    )
    for prompt, seq in zip(prompts, seqs, strict=True):
        want_tokens, want_logits = hf_greedy(model_dir, torch.float32, tuple(prompt))
        assert seq.output_token_ids == want_tokens, f"prompt of {len(prompt)} tokens"
        got_logits = torch.stack(engine.logits[seq.request_id])
        assert got_logits.shape == want_logits.shape
        max_err = (got_logits - want_logits).abs().max().item()
        assert max_err < 1e-4, f"prompt of {len(prompt)}: max |logit diff| {max_err:.2e}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "olmo2", "granite"])
@pytest.mark.parametrize(
    ("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_half_precision_greedy_tokens_match_transformers(make_tiny, arch, dtype, torch_dtype):
    """Exact equality holds because the model mirrors transformers' op order and casts."""
    model_dir = make_tiny(arch)
    prompts = make_prompts()
    _, seqs = run_engine(model_dir, prompts, block_size=16, num_blocks=128, dtype=dtype)
    for prompt, seq in zip(prompts, seqs, strict=True):
        want, _ = hf_greedy(model_dir, torch_dtype, tuple(prompt))
        assert seq.output_token_ids == want, f"{dtype}: prompt of {len(prompt)} tokens"


def test_chunked_prefill_yields_the_same_tokens_as_one_pass(tiny_llama):
    (prompt,) = make_prompts((300,), seed=1)
    _, (one_pass,) = run_engine(tiny_llama, [prompt], block_size=16, num_blocks=64)
    engine = make_engine(tiny_llama, block_size=16, num_blocks=64, max_num_batched_tokens=64)
    (seq,) = [engine.add_request(prompt, GREEDY)]
    chunk_sizes = []
    while seq.num_computed_tokens < len(prompt):
        chunk_sizes.append(engine.step().plan.num_batched_tokens)
    assert chunk_sizes == [64, 64, 64, 64, 44]
    while engine.has_unfinished:
        engine.step()
    assert seq.output_token_ids == one_pass.output_token_ids
    assert seq.output_token_ids == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]


def test_prefix_cache_hit_skips_three_blocks_and_keeps_tokens(tiny_llama):
    block_size = 16
    shared = make_prompts((3 * block_size,), seed=2)[0]
    first = shared + make_prompts((5,), seed=3)[0]
    second = shared + make_prompts((9,), seed=4)[0]

    engine = make_engine(tiny_llama, block_size=16, num_blocks=64)
    engine.generate([first], GREEDY)
    seq = engine.add_request(second, GREEDY)
    prefill_tokens = engine.step().plan.num_batched_tokens
    while engine.has_unfinished:
        engine.step()

    assert seq.num_cached_prompt_tokens == 3 * block_size
    assert prefill_tokens == len(second) - 3 * block_size
    _, (uncached,) = run_engine(
        tiny_llama, [second], block_size=16, num_blocks=64, enable_prefix_caching=False
    )
    assert seq.output_token_ids == uncached.output_token_ids
    assert seq.output_token_ids == hf_greedy(tiny_llama, torch.float32, tuple(second))[0]
