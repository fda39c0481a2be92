"""The 8-bit KV cache against transformers: the engine's greedy tokens equal transformers'
`generate` whose cache writes each K/V token with the same rule and attends over the
dequantized values (tests/support/oracle.py `hf_greedy_kv8`), for int8 and e4m3, prompts within one
block and across several, and decode steps across block boundaries. The rule itself is pinned
in tests/kernels/test_kv_quant.py."""

from __future__ import annotations

import pytest
import torch
from support.oracle import hf_greedy_kv8, make_prompts

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.sampling_params import SamplingParams

NEW_TOKENS = 20
BLOCK = 8


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_the_engine_with_8bit_kv_equals_transformers_with_the_same_cache(tiny_llama, kv):
    prompts = make_prompts((3, 8, 21, 40), seed=5)
    config = DecodeEngineConfig(block_size=BLOCK, num_blocks=64, num_swap_blocks=0,
                                kv_cache_dtype=kv)  # fmt: skip
    engine = DecodeEngine.from_model_dir(str(tiny_llama), config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        got = [s.output_token_ids for s in engine.generate(prompts, params)]
    finally:
        engine.close()
    codes = torch.int8 if kv == "int8" else torch.float8_e4m3fn
    want = [hf_greedy_kv8(tiny_llama, p, NEW_TOKENS, codes, BLOCK) for p in prompts]
    assert got == want
