"""The host tier in both engines (--kv-offload-memory): a prefix evicted from a small device
pool by other traffic is promoted back from host memory, its prompt tokens counted as cached
(not computed), and the tokens still equal transformers'."""

from __future__ import annotations

import torch
from support.oracle import GREEDY, hf_greedy_on, hf_model, make_engine, make_prompts
from support.tiers import run_waves

from pagedserve.decode_worker.plan import PreemptionMode
from pagedserve.prefill_worker.engine import PrefillEngine, PrefillEngineConfig
from pagedserve.sampling_params import SamplingParams

BLOCK = 8
PREFIX, TAIL_A, TAIL_B, OTHER_1, OTHER_2 = make_prompts((40, 3, 5, 60, 60), seed=5)
PROMPT_A, PROMPT_B = PREFIX + TAIL_A, PREFIX + TAIL_B
SHORT = SamplingParams(temperature=0.0, max_tokens=12)


def hf_b(model_dir) -> list[int]:
    return hf_greedy_on(hf_model(model_dir, torch.float32), PROMPT_B, SHORT.max_tokens)


def run_decode(model_dir, offload_blocks: int):
    """A, two other prompts (evicting A's blocks from the 12-block pool), then B = A's prefix
    + another tail; the engine's integrity is checked after every step."""
    engine = make_engine(
        model_dir, block_size=BLOCK, num_blocks=12, max_num_batched_tokens=64,
        kv_offload_blocks=offload_blocks,
    )  # fmt: skip
    for prompt in (PROMPT_A, OTHER_1, OTHER_2):
        engine.add_request(prompt, SHORT)
        while engine.has_unfinished:
            engine.step()
            engine.check_integrity()
    seq = engine.add_request(PROMPT_B, SHORT)
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    engine.close()
    return engine, seq


def test_decode_engine_serves_an_evicted_prefix_from_the_host_tier(tiny_llama):
    engine, seq = run_decode(tiny_llama, offload_blocks=32)
    counts = engine.kv.offload.counts()
    assert counts.writes >= len(PREFIX) // BLOCK, "the prefix must leave the device pool"
    assert counts.promotions == len(PREFIX) // BLOCK
    assert counts.promotion_bytes == counts.promotions * engine.runner.spec.bytes_per_block
    assert seq.num_cached_prompt_tokens == len(PREFIX), "promoted, not recomputed"
    assert seq.output_token_ids == hf_b(tiny_llama)


def test_decode_engine_without_the_tier_recomputes_the_evicted_prefix(tiny_llama):
    engine, seq = run_decode(tiny_llama, offload_blocks=0)
    assert engine.kv.offload is None
    assert seq.num_cached_prompt_tokens == 0
    assert seq.output_token_ids == hf_b(tiny_llama)


def prefill(engine: PrefillEngine, request_id: str, prompt: list[int]):
    seq = engine.new_sequence(prompt, GREEDY, request_id=request_id)
    engine.add_sequence(seq)
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    engine.free(seq.block_table)  # the lease ends at once: full blocks stay cached
    engine.check_integrity()
    return seq


def test_prefill_engine_promotes_an_evicted_prefix_and_counts_it_cached(tiny_llama):
    config = PrefillEngineConfig(
        block_size=BLOCK, num_blocks=8, max_num_batched_tokens=64, use_shm=False,
        kv_offload_blocks=16,
    )  # fmt: skip
    engine = PrefillEngine.from_model_dir(str(tiny_llama), config)
    prefill(engine, "a", PROMPT_A)
    prefill(engine, "o1", OTHER_1)
    assert engine.count_cached([PREFIX], "") == 0, "the prefix must leave the device pool"
    computed = engine.num_prompt_tokens_computed
    seq = prefill(engine, "b", PROMPT_B)
    assert seq.num_cached_prompt_tokens == len(PREFIX)
    assert engine.num_prompt_tokens_computed - computed == len(TAIL_B)
    assert engine.kv.offload.counts().promotions == len(PREFIX) // BLOCK
    assert seq.output_token_ids[:1] == hf_b(tiny_llama)[:1]
    engine.close()


def test_tier_with_swap_preemption_keeps_transformers_tokens(tiny_llama):
    """A pool too small for the batch: sequences are swapped out while prefixes move between
    the device and the host tier; integrity holds after every step and tokens stay exact."""
    engine = make_engine(
        tiny_llama, block_size=BLOCK, num_blocks=14, max_num_batched_tokens=32,
        num_swap_blocks=64, preemption_mode=PreemptionMode.SWAP, kv_offload_blocks=32,
    )  # fmt: skip
    assert not engine.kv.promote_on_match, "the decode engine promotes between steps only"
    assert engine.kv.offload.before_write == engine.swapper.wait_for_writes
    waves = [[PROMPT_A, OTHER_1], [OTHER_2, PROMPT_B, PREFIX + TAIL_A[:1], PREFIX + TAIL_B[:2]]]
    seqs, swapped = run_waves(engine, waves, SHORT)
    counts = engine.kv.offload.counts()
    assert swapped >= 1 and counts.promotions >= 1, (swapped, counts)
    model = hf_model(tiny_llama, torch.float32)
    for prompt, seq in zip([p for wave in waves for p in wave], seqs, strict=True):
        assert seq.output_token_ids == hf_greedy_on(model, prompt, SHORT.max_tokens)
