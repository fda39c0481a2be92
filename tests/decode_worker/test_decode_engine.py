"""DecodeEngine with the tiny Llama under KV pressure: preemption by swap, recompute and auto
must not change a single greedy token (vs the unconstrained run and transformers' generate)."""

from __future__ import annotations

import time
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.plan import KVPolicy, PreemptionMode
from pagedserve.kernels.dispatch import swap_blocks
from pagedserve.model.sequence import FinishReason, Sequence, SequenceStatus
from pagedserve.sampling_params import SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
PROMPT_LENS = (5, 12, 17, 23, 30, 38, 44, 9, 51, 27)
BLOCK_SIZE = 4
PRESSURE_BLOCKS = 100  # demand is ~150 blocks: sum of ceil((prompt + 32) / 4)


def make_prompts() -> list[list[int]]:
    """Mixed lengths; four prompts share a 16-token (4-block) prefix, so some blocks are shared."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 512, (16,), generator=g).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    for i in (2, 4, 6, 8):
        prompts[i] = shared + prompts[i]
    return prompts


def slow_copy(src: torch.Tensor, dst: torch.Tensor, pairs) -> None:
    """The real copy, late: every swap is still in flight when the engine checks on it."""
    if pairs:
        time.sleep(0.003)
    swap_blocks(src, dst, list(pairs))


def make_engine(model_dir: Path, **overrides) -> DecodeEngine:
    settings: dict = {
        "block_size": BLOCK_SIZE,
        "num_blocks": PRESSURE_BLOCKS,
        "num_swap_blocks": 64,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
        # a fixed cost model: swap wins for victims above ~10 blocks (see test_auto_...)
        "measure_costs": False,
        "swap_bytes_per_s": 2e6,
        "prefill_tokens_per_s": 1e3,
        "swap_overhead_s": 0.02,
    }
    settings.update(overrides)
    return DecodeEngine.from_model_dir(
        str(model_dir), DecodeEngineConfig(**settings), copy_fn=slow_copy
    )


def run_to_end(engine: DecodeEngine, seqs: list[Sequence]) -> None:
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    engine.close()
    assert engine.pool.num_used == 0, "finished sequences must hold no device blocks"
    assert engine.swap_space is None or engine.swap_space.pool.num_used == 0


@cache
def unconstrained(model_dir: Path) -> tuple[tuple[int, ...], ...]:
    engine = make_engine(model_dir, num_blocks=1000)
    seqs = engine.generate(make_prompts(), GREEDY)
    engine.check_integrity()
    engine.close()
    assert engine.stats.num_preemptions == 0
    return tuple(tuple(s.output_token_ids) for s in seqs)


@cache
def hf_greedy(model_dir: Path, prompt: tuple[int, ...]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The tiny model's matmuls are too small to split, and on a busy 2-core CI box two OpenMP
    threads per process oversubscribe the cores (10x slower); restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(make_tiny) -> Path:
    return make_tiny("llama")


def test_unconstrained_run_matches_transformers(model_dir):
    prompts = make_prompts()
    want = unconstrained(model_dir)
    for i in (0, 3, 4, 8):  # short, long, and two with the shared prefix
        assert list(want[i]) == hf_greedy(model_dir, tuple(prompts[i])), f"prompt {i}"


@pytest.mark.parametrize("mode", list(PreemptionMode), ids=lambda m: m.value)
def test_tokens_survive_preemption_under_kv_pressure(model_dir, mode):
    prompts = make_prompts()
    engine = make_engine(model_dir, preemption_mode=mode)
    seqs = engine.generate(prompts, GREEDY)
    engine.check_integrity()
    run_to_end(engine, seqs)

    assert tuple(tuple(s.output_token_ids) for s in seqs) == unconstrained(model_dir)
    assert seqs[1].output_token_ids == hf_greedy(model_dir, tuple(prompts[1]))
    stats, swapper = engine.stats, engine.swapper
    assert swapper is not None
    if mode is PreemptionMode.RECOMPUTE:
        assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
        assert swapper.stats.num_jobs == 0
    else:
        assert stats.num_preemptions_swap > 0
        assert stats.num_swap_out_blocks > 0 and stats.num_swap_in_blocks > 0
        assert swapper.stats.num_bytes_out == stats.num_swap_out_bytes > 0
        assert swapper.stats.num_bytes_in == stats.num_swap_in_bytes > 0
    if mode is PreemptionMode.AUTO:
        assert stats.num_preemptions_recompute > 0, "short victims are cheaper to recompute"


def test_swap_out_sources_are_copied_before_the_step_that_reuses_them(model_dir):
    engine = make_engine(model_dir, preemption_mode=PreemptionMode.SWAP)
    seqs = engine.generate(make_prompts(), GREEDY)
    run_to_end(engine, seqs)
    assert engine.swapper is not None and engine.swapper.stats.num_waits_for_swap_out > 0
    assert tuple(tuple(s.output_token_ids) for s in seqs) == unconstrained(model_dir)


def test_swap_space_too_small_recomputes_instead(model_dir):
    engine = make_engine(model_dir, preemption_mode=PreemptionMode.SWAP, num_swap_blocks=2)
    seqs = engine.generate(make_prompts(), GREEDY)
    run_to_end(engine, seqs)
    assert engine.stats.num_preemptions_recompute > 0
    assert tuple(tuple(s.output_token_ids) for s in seqs) == unconstrained(model_dir)


def test_high_priority_arrival_starts_within_one_step(model_dir):
    prompts = make_prompts()
    engine = make_engine(
        model_dir, max_num_seqs=4, num_blocks=1000, preemption_mode=PreemptionMode.SWAP
    )
    low = [engine.add_request(p, GREEDY, priority=10) for p in prompts[:4]]
    for _ in range(3):
        engine.step()
    high = engine.add_request(prompts[4], GREEDY, priority=0)

    out = engine.step()

    assert high.num_output_tokens == 1
    assert [(p.seq, p.mode) for p in out.plan.preempted] == [(low[3], PreemptionMode.SWAP)]
    run_to_end(engine, [*low, high])
    want = unconstrained(model_dir)
    assert [tuple(s.output_token_ids) for s in [*low, high]] == list(want[:5])


def test_equal_priorities_do_not_ping_pong(model_dir):
    engine = make_engine(model_dir, max_preemptions=1)
    seqs = [engine.add_request(p, GREEDY) for p in make_prompts()]  # all priority 0
    preemptions: Counter[str] = Counter()
    while engine.has_unfinished:
        preemptions.update(p.seq.request_id for p in engine.step().plan.preempted)
    engine.close()
    assert 0 < preemptions.total() <= len(seqs)
    assert max(preemptions.values()) == 1  # nobody is preempted twice, let alone back and forth
    assert tuple(tuple(s.output_token_ids) for s in seqs) == unconstrained(model_dir)


def test_abort_mid_stream_returns_every_block_at_once(model_dir):
    engine = make_engine(model_dir, preemption_mode=PreemptionMode.SWAP)
    seqs = [engine.add_request(p, GREEDY) for p in make_prompts()]
    while not any(s.status is SequenceStatus.SWAPPED for s in seqs):
        engine.step()
    swapped = next(s for s in seqs if s.status is SequenceStatus.SWAPPED)
    running = next(s for s in seqs if s.status is SequenceStatus.RUNNING)
    host_before = engine.swap_space.pool.num_used if engine.swap_space else 0
    used_before = engine.pool.num_used

    assert engine.abort(swapped.request_id) and engine.abort(running.request_id)
    assert not engine.abort(running.request_id)

    engine.check_integrity()
    assert engine.pool.num_used < used_before and running.block_table.block_ids == []
    assert engine.swap_space is not None and engine.swap_space.pool.num_used < host_before
    assert swapped.finish_reason is running.finish_reason is FinishReason.ABORT
    rest = [s for s in seqs if s not in (swapped, running)]
    run_to_end(engine, rest)
    want = dict(zip([s.request_id for s in seqs], unconstrained(model_dir), strict=True))
    assert all(tuple(s.output_token_ids) == want[s.request_id] for s in rest)


def test_request_that_cannot_fit_alone_ends_with_an_error(model_dir):
    engine = make_engine(model_dir, num_blocks=12)  # 48 token slots
    prompts = make_prompts()
    ok, too_big = engine.generate([prompts[0], prompts[5]], GREEDY)
    engine.close()
    assert too_big.finish_reason is FinishReason.ERROR and too_big.output_token_ids == []
    assert "KV cache holds only 12 blocks" in engine.errors[too_big.request_id]
    assert ok.finish_reason is not FinishReason.ERROR
    assert tuple(ok.output_token_ids) == unconstrained(model_dir)[0]


def test_reserve_max_policy_gives_the_same_tokens_without_preemption(model_dir):
    """The S3 baseline: same engine, worst-case slots held from admission, so sequences never
    grow into a full pool (no preemption) and fewer run at once."""
    prompts = make_prompts()
    engine = make_engine(model_dir, kv_policy=KVPolicy.RESERVE_MAX)
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    max_running = 0
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
        max_running = max(max_running, len(engine.scheduler.running))
        for entry in engine.scheduler.running:  # every running table covers its worst case
            seq = entry.seq
            assert seq.block_table.num_tokens >= seq.num_prompt_tokens + NEW_TOKENS
    run_to_end(engine, seqs)

    assert tuple(tuple(s.output_token_ids) for s in seqs) == unconstrained(model_dir)
    assert engine.stats.num_preemptions == 0
    assert max_running < len(prompts), "the reservation must keep some sequences waiting"
