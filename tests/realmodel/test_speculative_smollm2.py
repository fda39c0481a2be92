"""Speculative decoding on the real model (SmolLM2-135M-Instruct, fp32): an input-grounded chat
prompt (bench/grounded.py's, as S17 sends it), n-gram lookup: most proposals are accepted and
the 48 greedy tokens equal transformers' `generate(do_sample=False)`."""

from __future__ import annotations

import torch
from support.oracle import hf_greedy_on, hf_model
from transformers import AutoTokenizer

from pagedserve.bench.grounded import grounded_prompts
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.speculation import SpeculativeConfig
from pagedserve.sampling_params import SamplingParams


def test_ngram_speculation_on_a_grounded_prompt_keeps_transformers_tokens(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": grounded_prompts(1, seed=3)[0]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    config = DecodeEngineConfig(num_blocks=64, num_swap_blocks=0,
                                speculative=SpeculativeConfig(num_tokens=4))  # fmt: skip
    engine = DecodeEngine.from_model_dir(str(smollm2_dir), config)
    (seq,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48))
    stats = engine.speculation_stats
    engine.check_integrity()
    engine.close()
    print(f"SmolLM2, grounded prompt: {stats}")
    assert stats is not None and stats.acceptance_rate > 0.5
    assert seq.output_token_ids == hf_greedy_on(hf_model(smollm2_dir, torch.float32), prompt, 48)
