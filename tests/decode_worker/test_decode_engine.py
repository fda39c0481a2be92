"""DecodeEngine with the tiny Llama under KV pressure: preemption by swap, recompute and auto
must not change a single greedy token (vs the unconstrained run and transformers' generate)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.decode_worker.convert import KvHandleInfo
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.kv_import import HANDLE_VERSION, KvImporter
from pagedserve.decode_worker.plan import KVPolicy, PreemptionMode, SwapDirection
from pagedserve.kernels.dispatch import swap_blocks
from pagedserve.kvstore.transfer import layout_compat_hash
from pagedserve.model.requests.sequence import FinishReason, Sequence, SequenceStatus
from pagedserve.model.runner import ScheduledSequence
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


def add_imported(
    engine: DecodeEngine, prompt: list[int], params: SamplingParams, first_token: int, priority: int
) -> Sequence:
    """What `KvImporter` + `DecodeWorker` do for an imported prompt: fill a fresh table with the
    prompt's KV (here computed by the engine's runner instead of pulled), then `add_prefilled`.
    It joins `running` even while better-ranked sequences are swapped out."""
    seq = engine.new_sequence(prompt, params, priority=priority)
    assert engine.kv.allocate(seq.block_table, len(prompt)) == []
    assert engine.swapper is not None
    engine.swapper.wait_for_writes(seq.block_table.block_ids)
    engine.runner.execute([ScheduledSequence(seq, len(prompt))])
    engine.kv.cache_full_blocks(seq.block_table, seq.block_hashes, len(prompt))
    seq.num_computed_tokens = len(prompt)
    seq.append_token(first_token, None)
    engine.add_prefilled(seq)
    return seq


def test_victim_swapped_out_for_a_swap_in_keeps_its_kv_when_the_swap_in_reuses_its_blocks(
    model_dir,
):
    """A swapped sequence displaces a running one and is swapped in, in one step, into the
    device blocks the victim has just freed: the victim's swap-out must read them first (the
    soak's wrong token at index 1 when the Swapper ran every swap-in before every swap-out)."""
    g = torch.Generator().manual_seed(3)
    p_high, p_top, p_low = (torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 24, 25))
    engine = make_engine(
        model_dir, num_blocks=8, num_swap_blocks=16, preemption_mode=PreemptionMode.SWAP
    )
    high = engine.add_request(p_high, SamplingParams(temperature=0.0, max_tokens=12), priority=0)
    engine.step()
    engine.step()
    top = engine.add_request(p_top, SamplingParams(temperature=0.0, max_tokens=8), priority=-1)
    assert [p.seq for p in engine.step().plan.preempted] == [high]  # swapped out for `top`
    assert engine.abort(top.request_id)
    want_low = hf_greedy(model_dir, tuple(p_low))[:6]
    low = add_imported(
        engine, p_low, SamplingParams(temperature=0.0, max_tokens=6), want_low[0], priority=5
    )
    assert engine.pool.num_allocatable == 1  # `high` (3 blocks) must displace `low` to return

    plan = engine.step().plan

    assert [(p.seq, p.mode) for p in plan.preempted] == [(low, PreemptionMode.SWAP)]
    assert plan.swapped_in == [high]
    assert [c.direction for c in plan.swaps] == [SwapDirection.OUT, SwapDirection.IN]
    reused = {d for _, d in plan.swap_in} & {d for d, _ in plan.swap_out}
    assert reused, "the swap-in must fill blocks the victim's swap-out reads"
    run_to_end(engine, [high, low])
    assert low.output_token_ids == want_low
    assert high.output_token_ids == hf_greedy(model_dir, tuple(p_high))[:12]


def test_step_waits_while_a_kv_import_holds_the_blocks_a_swapped_sequence_needs(model_dir):
    """Nothing running, a swapped sequence that does not fit because an import's table (not
    yet handed over) holds the blocks: an empty step, not "nothing schedulable" (the soak's
    FINISH_REASON_ERROR: the worker failed every request after that RuntimeError)."""
    g = torch.Generator().manual_seed(3)
    p_high, p_top, p_import = (
        torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 24, 25)
    )
    engine = make_engine(
        model_dir, num_blocks=8, num_swap_blocks=16, preemption_mode=PreemptionMode.SWAP
    )
    high = engine.add_request(p_high, SamplingParams(temperature=0.0, max_tokens=12), priority=0)
    engine.step()
    engine.step()
    top = engine.add_request(p_top, SamplingParams(temperature=0.0, max_tokens=8), priority=-1)
    assert [p.seq for p in engine.step().plan.preempted] == [high]
    assert engine.abort(top.request_id)
    importing = engine.new_sequence(p_import, SamplingParams(temperature=0.0, max_tokens=6))
    assert engine.kv.allocate(importing.block_table, len(p_import)) == []  # its pull in flight

    assert engine.step().plan.is_empty and engine.num_block_refs_outside == 7

    engine.kv.free(importing.block_table)  # the import failed: its blocks come back
    assert engine.step().plan.swapped_in == [high]
    run_to_end(engine, [high])
    assert high.output_token_ids == hf_greedy(model_dir, tuple(p_high))[:12]


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


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE], ids=str)
def test_an_8bit_kv_cache_gives_the_same_tokens_under_preemption(model_dir, mode):
    """Swap moves each block's scales with its codes, and a recomputed block (prefill chunks
    instead of decode steps) holds the codes it held before: kernels/kv_quant.py."""
    free = make_engine(model_dir, num_blocks=1000, kv_cache_dtype="int8")
    assert free.runner.spec.dtype == torch.int8
    want = [s.output_token_ids for s in free.generate(make_prompts(), GREEDY)]
    free.close()
    assert free.stats.num_preemptions == 0
    engine = make_engine(model_dir, preemption_mode=mode, kv_cache_dtype="int8")
    seqs = engine.generate(make_prompts(), GREEDY)
    run_to_end(engine, seqs)
    assert [s.output_token_ids for s in seqs] == want
    if mode is PreemptionMode.SWAP:
        assert engine.stats.num_preemptions_swap > 0 and engine.stats.num_swap_in_blocks > 0
    else:
        assert engine.stats.num_preemptions_recompute > 0


def test_a_handle_from_a_worker_with_another_kv_dtype_is_refused_naming_the_flag(model_dir):
    """Blocks of another KV dtype never enter the cache (the compat hash differs), and the
    reason says which flag to align."""
    engine = make_engine(model_dir, num_blocks=64, kv_cache_dtype="int8")
    importer = KvImporter(engine, threading.RLock(), producers=None)  # type: ignore[arg-type]
    seq = engine.new_sequence(make_prompts()[0], GREEDY)
    bf16_like = replace(engine.runner.spec, dtype=torch.float32)
    handle = KvHandleInfo(
        version=HANDLE_VERSION, handle_id="h", producer_id="p", producer_incarnation="i",
        producer_address="", num_tokens=seq.num_prompt_tokens, block_size=BLOCK_SIZE,
        block_ids=(), block_hashes=(), layout_block_size=BLOCK_SIZE,
        compat_hash=layout_compat_hash(bf16_like, engine.fingerprint),
        lease_expires_unix_ms=0, shm=None, grpc_address="", layout_dtype="float32",
    )  # fmt: skip
    reason = importer._check(seq, handle)  # noqa: SLF001 - the refusal's reason, before any pull
    assert reason is not None and "--kv-cache-dtype" in reason and "int8" in reason
    engine.close()
