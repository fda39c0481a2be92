"""Config variants the runtime must follow as transformers does: rope scaling, sliding windows,
tied embeddings, mixed prefill/decode batches, seeded sampling, and clear loading errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.oracle import GREEDY, hf_greedy, make_engine, make_prompts, run_engine

from pagedserve.model.config import load_model_config
from pagedserve.model.loader import load_model
from pagedserve.model.requests.sequence import FinishReason
from pagedserve.sampling_params import SamplingParams

# NOTE: the scaled ropes' original context (64) is shorter than the longest prompt (130) and
# than the second prompt's output (40 + 32 tokens), so their scaling is exercised where it acts
ORIGINAL_CONTEXT = 64
VARIANTS = {
    "rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "rope-llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIGINAL_CONTEXT,
            }
        },
    ),
    "rope-yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL_CONTEXT,
            }
        },
    ),
    "mistral-sliding-window-24": ("mistral", {"sliding_window": 24}),
    "mixtral-sliding-window-24": ("mixtral", {"sliding_window": 24}),  # Mistral's rule, experts
    # NOTE: layer 0 windowed, layer 1 full attention, as Qwen2MoeConfig lays them out
    "qwen2_moe-sliding-window-24": ("qwen2_moe", {"sliding_window": 24}),
    # NOTE: layer 0 full attention, layer 1 windowed (max_window_layers), as Qwen lays them out
    "qwen3-sliding-window-24": ("qwen3", {"sliding_window": 24}),
    "tied-embeddings": ("llama", {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variant_greedy_tokens_and_logits_match_transformers(make_tiny, variant):
    """fp32, with prefill in chunks of at most 48 tokens beside the other prompts' decodes."""
    arch, kwargs = VARIANTS[variant]
    model_dir = make_tiny(arch, **kwargs)
    prompts = make_prompts((5, 40, 130))
    engine, seqs = run_engine(
        model_dir, prompts, record_logits=True, block_size=8, num_blocks=64,
        max_num_batched_tokens=48,
    )  # fmt: skip
    for prompt, seq in zip(prompts, seqs, strict=True):
        want, want_logits = hf_greedy(model_dir, torch.float32, tuple(prompt))
        assert seq.output_token_ids == want, f"{variant}: prompt of {len(prompt)} tokens"
        max_err = (torch.stack(engine.logits[seq.request_id]) - want_logits).abs().max().item()
        assert max_err < 1e-4, f"{variant}: prompt of {len(prompt)}: max |logit diff| {max_err:.2e}"


REFUSED_ROPES = {
    # NOTE: transformers grows dynamic's base past max_position_embeddings, and switches longrope
    # to its long factors past the original context, per forward (model/config.py)
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [4.0] * 8,
        "original_max_position_embeddings": ORIGINAL_CONTEXT,
    },
}


@pytest.mark.parametrize("rope_type", sorted(REFUSED_ROPES))
def test_a_rope_type_served_wrong_is_refused_at_load_naming_it(tiny_llama, tmp_path, rope_type):
    model_dir = tmp_path / rope_type
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("rope_parameters", None)  # NOTE: written as Llama 3's config.json spells rope
    config["rope_scaling"] = REFUSED_ROPES[rope_type]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"rope_scaling.rope_type '{rope_type}'") as info:
        load_model_config(model_dir)
    assert "default, linear, llama3, yarn" in str(info.value)


def test_mixed_prefill_chunks_and_decodes_in_one_forward_match_transformers(tiny_llama):
    """A small token budget forces steps that carry decode tokens and prefill chunks together."""
    prompts = make_prompts((3, 90, 20, 150, 1, 64), seed=5)
    engine = make_engine(tiny_llama, block_size=16, num_blocks=64, max_num_batched_tokens=48)
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    mixed_steps = 0
    while engine.has_unfinished:
        running = [entry.seq for entry in engine.scheduler.running]
        decoding = [s for s in running if s.num_computed_tokens >= s.num_prompt_tokens]
        prefilling = len(running) + len(engine.scheduler.waiting) - len(decoding)
        out = engine.step()
        mixed_steps += bool(decoding) and prefilling > 0 and out.plan.num_batched_tokens > 1
    assert mixed_steps >= 3
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(tiny_llama, torch.float32, tuple(prompt))[0]


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama):
    prompt = make_prompts((12,), seed=6)[0]
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=16)
    _, (alone,) = run_engine(tiny_llama, [prompt], block_size=16, num_blocks=64)
    engine = make_engine(tiny_llama, block_size=16, num_blocks=128)
    solo = engine.generate([prompt], params)[0].output_token_ids
    others = make_prompts((7, 33, 60), seed=7)
    mixed = engine.generate(
        [others[0], prompt, others[1], others[2]],
        [SamplingParams(temperature=1.0, max_tokens=16), params, GREEDY, params],
    )
    assert mixed[1].output_token_ids == solo
    assert solo != alone.output_token_ids, "sampling at T=0.9 should leave the greedy path"


def test_unsupported_architecture_is_a_clear_error(tiny_llama, tmp_path):
    model_dir = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model_config(model_dir)
    for supported in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM",
                      "GraniteForCausalLM"):  # fmt: skip
        assert supported in str(info.value)


def test_missing_files_are_clear_errors(tiny_llama, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(tmp_path)
    model_dir = tmp_path / "no-weights"
    shutil.copytree(tiny_llama, model_dir)
    (model_dir / "model.safetensors").unlink()
    config = load_model_config(model_dir)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(config)


def test_missing_tensor_is_named(tiny_llama, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "partial"
    shutil.copytree(tiny_llama, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(load_model_config(model_dir))


def test_bad_requests_raise_invalid_argument_naming_the_field(tiny_llama):
    from pagedserve.errors import InvalidArgument

    engine = make_engine(tiny_llama, block_size=16, num_blocks=8)
    cases = {
        "prompt_token_ids": ([], GREEDY),
        "prompt_token_ids ": ([5, 10_000], GREEDY),
        "temperature": ([5], SamplingParams(temperature=-1.0)),
    }
    for field, (prompt, params) in cases.items():
        with pytest.raises(InvalidArgument) as info:
            engine.add_request(prompt, params)
        assert info.value.field == field.strip()
    assert not engine.has_unfinished


def test_a_request_that_can_never_fit_ends_with_error_and_holds_nothing(tiny_llama):
    engine = make_engine(tiny_llama, block_size=16, num_blocks=8)
    too_big = SamplingParams(max_tokens=100)  # 200 tokens > 8 blocks of 16
    assert not engine.would_fit(100, too_big.max_tokens)
    seq = engine.add_request([5] * 100, too_big)
    assert seq.finish_reason is FinishReason.ERROR
    (finished,) = engine.step().finished
    assert finished is seq and "8 blocks" in engine.errors[seq.request_id]
    assert not engine.has_unfinished and engine.pool.num_used == 0
    engine.check_integrity()
