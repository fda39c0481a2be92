"""The one-call native decode stack (model/native_stack.py) against the layer-by-layer path.

Both run the same native kernels; the stack differs only in SiLU's exponential, so greedy tokens
are equal and logits agree to float32 rounding. The oracle tests (test_oracle.py and friends)
already pass through the stack wherever it takes a step; these pin that it does take them, and
that it declines what its kernels do not compute.
"""

from __future__ import annotations

import pytest
import torch
from support.oracle import hf_greedy, make_engine, make_prompts, run_engine

from pagedserve.decode_worker.speculation import SpeculativeConfig
from pagedserve.kernels import cpu_linear, cpu_native, cpu_stack, mkl_packed
from pagedserve.kernels.dispatch import AttentionMetadata
from pagedserve.model import config as config_module
from pagedserve.model import native_stack
from pagedserve.model.native_stack import NativeStack
from pagedserve.model.quant import weight_quant

pytestmark = pytest.mark.skipif(
    cpu_native.unavailable_reason() is not None, reason="the native CPU kernels do not build here"
)

MODELS = {
    "llama": ("llama", {}),
    "mistral-window-12": ("mistral", {"sliding_window": 12}),
    "qwen2-qkv-bias": ("qwen2", {}),
}


@pytest.fixture
def stack_calls(monkeypatch):
    """How many steps ran through the stack."""
    calls = []
    run = cpu_stack.run
    monkeypatch.setattr(cpu_stack, "run", lambda *a: (calls.append(1), run(*a))[1])
    return calls


def _decode(model_dir, quantization, prompts, num_blocks=96):
    engine, seqs = run_engine(
        model_dir, prompts, record_logits=True, block_size=8, num_blocks=num_blocks,
        quantization=weight_quant(quantization),
    )  # fmt: skip
    return [(s.output_token_ids, torch.stack(engine.logits[s.request_id])) for s in seqs]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_one_call_stack_gives_the_layer_by_layer_tokens_and_logits(
    make_tiny, monkeypatch, stack_calls, model, quantization
):
    arch, kwargs = MODELS[model]
    model_dir = make_tiny(arch, **kwargs)
    prompts = make_prompts((5, 30, 70))
    stacked = _decode(model_dir, quantization, prompts)
    assert len(stack_calls) >= 15, "decode steps must run through the stack"
    monkeypatch.setattr(native_stack, "enabled", False)
    calls_before = len(stack_calls)
    layered = _decode(model_dir, quantization, prompts)
    assert len(stack_calls) == calls_before
    for (tokens, logits), (want_tokens, want_logits) in zip(stacked, layered, strict=True):
        assert tokens == want_tokens
        assert (logits - want_logits).abs().max().item() < 1e-4
    if quantization is None:
        for prompt, (tokens, _) in zip(prompts, stacked, strict=True):
            assert tokens == hf_greedy(model_dir, torch.float32, tuple(prompt))[0]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_speculative_chunks_through_the_stack_give_the_layer_by_layer_tokens_and_logits(
    make_tiny, monkeypatch, stack_calls, model, quantization
):
    """Verification feeds a sequence 1 + k tokens: the stack attends row by row, causally (a
    sliding window per row), and matches the Python path's batched chunk attention."""
    arch, kwargs = MODELS[model]
    model_dir = make_tiny(arch, **kwargs)
    prompts = make_prompts((5, 30, 70))
    config = dict(record_logits=True, block_size=8, num_blocks=96,
                  quantization=weight_quant(quantization),
                  speculative=SpeculativeConfig(num_tokens=4))  # fmt: skip
    engine, seqs = run_engine(model_dir, prompts, **config)
    stacked = [(s.output_token_ids, torch.stack(engine.logits[s.request_id])) for s in seqs]
    assert engine.speculation_stats.num_drafts > 5 and len(stack_calls) >= 15
    monkeypatch.setattr(native_stack, "enabled", False)
    engine, seqs = run_engine(model_dir, prompts, **config)
    layered = [(s.output_token_ids, torch.stack(engine.logits[s.request_id])) for s in seqs]
    for (tokens, logits), (want_tokens, want_logits) in zip(stacked, layered, strict=True):
        assert tokens == want_tokens
        assert (logits - want_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("packed", [True, False], ids=["mkl-packed", "native-gemm"])
def test_fp32_batches_past_16_rows_take_a_gemm_in_the_stack_too(tiny_llama, monkeypatch,
                                                                stack_calls, packed):  # fmt: skip
    monkeypatch.setattr(mkl_packed, "enabled", packed)
    prompts = make_prompts([5 + 3 * i for i in range(20)])  # 20 decoding at once: the GEMM
    stacked = _decode(tiny_llama, None, prompts, num_blocks=160)
    assert len(stack_calls) >= 15
    monkeypatch.setattr(native_stack, "enabled", False)
    layered = _decode(tiny_llama, None, prompts, num_blocks=160)
    for (tokens, logits), (want_tokens, want_logits) in zip(stacked, layered, strict=True):
        assert tokens == want_tokens
        assert (logits - want_logits).abs().max().item() < 1e-4
    for prompt, (tokens, _) in zip(prompts[::5], stacked[::5], strict=True):
        assert tokens == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]


def _model_and_cache(model_dir, **config):
    engine = make_engine(model_dir, block_size=8, num_blocks=32, **config)
    return engine.runner.model, engine.runner.kv_cache


def test_the_stack_is_built_for_fp32_and_8_and_4_bit_weights(tiny_llama):
    for quantization in (None, "int8", "int4"):
        model, cache = _model_and_cache(tiny_llama, quantization=weight_quant(quantization))
        stack = NativeStack.build(model, cache)
        assert stack is not None, quantization
        # fp32: linear_f32 up to 16 rows, MKL on packed weights above (any batch), or without
        # MKL the native GEMM (to 64 rows on Intel)
        gemm = 256 if mkl_packed.available() else min(256, cpu_linear.GEMM_MAX_TOKENS)
        expected = 256 if quantization else gemm
        assert stack.max_rows == expected, quantization


@pytest.mark.parametrize(
    "config", [{"dtype": "bfloat16"}, {"kv_cache_dtype": "int8"}], ids=["bf16", "int8-kv-cache"]
)
def test_the_stack_declines_what_its_kernels_do_not_compute(tiny_llama, config):
    model, cache = _model_and_cache(tiny_llama, **config)
    assert NativeStack.build(model, cache) is None


def test_the_stack_declines_a_layer_with_an_attention_soft_cap(tiny_llama):
    """Its attention kernel is called without a soft cap: a capped layer (Gemma 2's
    `Attention.softcap`) must take the layer path, where dispatch applies the cap."""
    model, cache = _model_and_cache(tiny_llama)
    assert NativeStack.build(model, cache) is not None
    model.model.layers[-1].self_attn.softcap = 50.0
    assert NativeStack.build(model, cache) is None
    model.model.layers[-1].self_attn.softcap = None
    assert NativeStack.build(model, cache) is not None


def _meta(query_lens: list[int]) -> AttentionMetadata:
    rows = sum(query_lens)
    return AttentionMetadata(
        slot_mapping=torch.arange(rows),
        block_tables=torch.zeros(len(query_lens), 4, dtype=torch.int64),
        query_lens=query_lens, seq_lens=[8] * len(query_lens),
    )  # fmt: skip


def test_prefill_rows_and_batches_past_its_bound_take_the_layer_path(tiny_llama):
    model, cache = _model_and_cache(tiny_llama)
    stack = NativeStack.build(model, cache)
    assert stack is not None
    before = cache.tensor.clone()
    for query_lens in ([native_stack.MAX_CHUNK + 1, 1], [1] * (stack.max_rows + 1)):
        rows = sum(query_lens)
        ids, positions = torch.ones(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
        assert stack.forward(ids, positions, _meta(query_lens)) is None
    assert torch.equal(cache.tensor, before), "a declined step writes nothing"


def test_the_stack_declines_qwen3s_q_k_norms_and_the_layer_path_matches_transformers(
    tiny_qwen3, stack_calls
):
    """Its kernels compute Llama's attention: a layer with q/k norms must take the Python path
    (the same model without them would be built)."""
    model, cache = _model_and_cache(tiny_qwen3)
    assert NativeStack.build(model, cache) is None
    for layer in model.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    assert NativeStack.build(model, cache) is not None, "declined for another reason"
    prompts = make_prompts((5, 30))
    for prompt, (tokens, _) in zip(prompts, _decode(tiny_qwen3, None, prompts), strict=True):
        assert tokens == hf_greedy(tiny_qwen3, torch.float32, tuple(prompt))[0]
    assert not stack_calls


@pytest.mark.parametrize("arch", ["olmo2", "granite", "gemma2", "gemma3"])
def test_the_stack_declines_olmo2s_post_norms_granites_residual_multiplier_and_gemmas_layer(
    make_tiny, arch, stack_calls
):
    """OLMo 2's layer (norms after attention and MLP, q/k norms over the whole projections,
    norms weighted in float32), Granite's scaled residual branches and Gemma's layer (four
    (1 + weight) norms, GeGLU, a rope per layer type) are not what the kernels compute: their
    decode steps take the layer path, whose tokens are transformers'."""
    model_dir = make_tiny(arch)
    model, cache = _model_and_cache(model_dir)
    assert NativeStack.build(model, cache) is None
    prompts = make_prompts((5, 30))
    for prompt, (tokens, _) in zip(prompts, _decode(model_dir, None, prompts), strict=True):
        assert tokens == hf_greedy(model_dir, torch.float32, tuple(prompt))[0]
    assert not stack_calls


def test_the_stack_computes_with_granites_attention_scale_and_embedding_multiplier(
    make_tiny, monkeypatch, stack_calls
):
    """Granite's model with its residual multiplier at 1 (so the stack takes it): the stack's
    attention scale is `attention_multiplier` (0.15, not 1 / sqrt(16)) and its embeddings are
    multiplied, as on the layer path."""
    real = config_module._multipliers

    def unscaled_residuals(arch, hf):
        return {**real(arch, hf), "residual_multiplier": 1.0}

    monkeypatch.setattr(config_module, "_multipliers", unscaled_residuals)
    model_dir = make_tiny("granite")
    model, cache = _model_and_cache(model_dir)
    assert model.model.layers[0].self_attn.scale == 0.15
    assert NativeStack.build(model, cache) is not None
    prompts = make_prompts((5, 30))
    stacked = _decode(model_dir, None, prompts)
    assert len(stack_calls) >= 15, "decode steps must run through the stack"
    monkeypatch.setattr(native_stack, "enabled", False)
    layered = _decode(model_dir, None, prompts)
    for (tokens, logits), (want_tokens, want_logits) in zip(stacked, layered, strict=True):
        assert tokens == want_tokens
        assert (logits - want_logits).abs().max().item() < 1e-4


# A full-rotary Phi-3 with longrope (factors of head_dim / 2 = 8), original context 64
PHI3_FULL_LONGROPE = {
    "rope_type": "longrope", "original_max_position_embeddings": 64,
    "short_factor": [1.0 + 0.3 * i for i in range(8)],
    "long_factor": [2.0 + 1.5 * i for i in range(8)],
}  # fmt: skip


def test_the_stack_declines_phi3s_partial_rotary_and_reads_longropes_tables(make_tiny, stack_calls):
    """Its kernel rotates whole heads: Phi-3's partial rotary takes the layer path. A longrope
    model within its original context rotates by fixed (short-factor) tables, which the stack
    reads as the layer path does: tokens and logits are transformers'."""
    partial = make_tiny("phi3")
    assert NativeStack.build(*_model_and_cache(partial)) is None
    model_dir = make_tiny(
        "phi3", partial_rotary_factor=1.0, max_position_embeddings=256,
        rope_scaling=PHI3_FULL_LONGROPE,
    )  # fmt: skip
    assert NativeStack.build(*_model_and_cache(model_dir, max_model_len=64)) is not None
    prompts = make_prompts((5, 30))
    engine, seqs = run_engine(
        model_dir, prompts, record_logits=True, block_size=8, num_blocks=32, max_model_len=64
    )
    assert len(stack_calls) >= 15, "decode steps must run through the stack"
    for prompt, seq in zip(prompts, seqs, strict=True):
        want_tokens, want_logits = hf_greedy(model_dir, torch.float32, tuple(prompt))
        assert seq.output_token_ids == want_tokens
        got = torch.stack(engine.logits[seq.request_id])
        assert (got - want_logits).abs().max().item() < 1e-4
