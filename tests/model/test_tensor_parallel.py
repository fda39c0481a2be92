"""Tensor parallelism (model/tensor_parallel.py, model/tp_ranks.py, model/tp_pipes.py) on CPU
with gloo: a decode engine of 2 rank processes gives transformers' greedy tokens, with 2 KV heads
(split) and 1 (replicated), under swap and recompute preemption too; shapes that do not split are
refused naming the flag; a rank that dies fails the step instead of hanging, and nothing is left
running."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from support.oracle import hf_greedy_on, hf_model, make_prompts

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.plan import PreemptionMode
from pagedserve.model.config import load_model_config
from pagedserve.model.tensor_parallel import Shard
from pagedserve.model.tp_pipes import RankStepMessage
from pagedserve.model.tp_ranks import _run
from pagedserve.sampling_params import SamplingParams

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def engine(model_dir, **settings) -> DecodeEngine:
    settings = {"block_size": 4, "num_blocks": 256, "num_swap_blocks": 0, **settings}
    return DecodeEngine.from_model_dir(str(model_dir), DecodeEngineConfig(**settings))


def greedy(model_dir, prompts, **settings) -> tuple[list[list[int]], DecodeEngine]:
    eng = engine(model_dir, **settings)
    try:
        out = [s.output_token_ids for s in eng.generate(prompts, GREEDY)]
        eng.check_integrity()
        return out, eng
    finally:
        eng.close()


def children() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedserve-tp")]


@pytest.fixture(params=[2, 1], ids=["2-kv-heads", "1-kv-head"])
def model_dir(request, make_tiny):
    return make_tiny("llama", heads=4, kv_heads=request.param, layers=2)


def test_two_ranks_equal_transformers(model_dir):
    prompts = make_prompts((1, 6, 17, 40), seed=3)
    want = [hf_greedy_on(hf_model(model_dir, torch.float32), p, NEW_TOKENS) for p in prompts]
    got, eng = greedy(model_dir, prompts, tensor_parallel_size=2)
    assert got == want
    # rank 0 holds its shard: half the heads; the KV heads split, or one replicated
    config = eng.runner.config
    assert config.num_heads == 2 and config.num_kv_heads == 1 and config.tp is not None
    assert eng.runner.kv_cache.spec.num_kv_heads == 1
    assert children() == []


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE],
                         ids=lambda m: m.value)  # fmt: skip
def test_two_ranks_under_preemption_equal_one(make_tiny, mode):
    model_dir = make_tiny("llama", heads=4, kv_heads=2, layers=2)
    prompts = make_prompts((5, 12, 17, 23, 30, 38), seed=5)
    pressure = {"num_blocks": 30, "num_swap_blocks": 64, "max_num_batched_tokens": 64,
                "preemption_mode": mode, "measure_costs": False}  # fmt: skip
    want, _ = greedy(model_dir, prompts)
    got, eng = greedy(model_dir, prompts, tensor_parallel_size=2, **pressure)
    assert got == want
    stats = eng.stats
    if mode is PreemptionMode.SWAP:
        assert stats.num_preemptions_swap > 0 and stats.num_swap_in_blocks > 0
    else:
        assert stats.num_preemptions_recompute > 0


def test_the_ranks_share_the_workers_thread_count(make_tiny):
    """`ModelRunner.set_threads(T)` (what the host's core share calls before a step) gives
    each of N ranks T // N torch threads: rank 0 at once, the others through the next plan,
    which applies it before its step (`_run`); a plan without a count changes nothing."""
    model_dir = make_tiny("llama", heads=4, kv_heads=2, layers=2)
    prompts = make_prompts((5, 9), seed=8)
    want, _ = greedy(model_dir, prompts)
    seen: dict[str, object] = {}

    def on_a_worker_thread() -> None:  # NOTE: torch's thread count is per thread
        eng = engine(model_dir, tensor_parallel_size=2)
        sent: list[int] = []
        send = eng.runner.ranks.send
        eng.runner.ranks.send = lambda plan: (send(plan), sent.append(plan.threads))[0]
        try:
            eng.runner.set_threads(4)
            seen["rank 0"] = torch.get_num_threads()
            seen["tokens"] = [s.output_token_ids for s in eng.generate(prompts, GREEDY)]
            seen["sent"] = sent
            # what a rank process runs per plan, here on rank 0's runner (no forward)
            torch.set_num_threads(3)
            _run(eng.runner, None, RankStepMessage(threads=1))
            seen["a rank, told 1"] = torch.get_num_threads()
            _run(eng.runner, None, RankStepMessage())
            seen["then no count"] = torch.get_num_threads()
        finally:
            eng.close()

    thread = threading.Thread(target=on_a_worker_thread)
    thread.start()
    thread.join(120)
    assert seen.pop("tokens") == want
    sent = seen.pop("sent")
    assert sent[0] == 2 and set(sent[1:]) == {0}, sent  # once, with the first step's plan
    assert seen == {"rank 0": 2, "a rank, told 1": 1, "then no count": 1}


def test_shapes_that_do_not_split_name_the_flag(make_tiny):
    config = load_model_config(make_tiny("llama", heads=4, kv_heads=2, layers=2))
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the model's 4"):
        Shard.of(config, 0, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        DecodeEngineConfig(tensor_parallel_size=0)
    shard = Shard.of(config, 1, 4)  # 4 ranks over 2 KV heads: rank 1 holds KV head 0
    assert (shard.local_heads, shard.local_kv_heads, shard.first_kv_head) == (1, 1, 0)
    assert Shard.of(config, 3, 4).first_kv_head == 1


def test_a_dead_rank_fails_the_step_and_leaves_nothing_running(make_tiny):
    model_dir = make_tiny("llama", heads=4, kv_heads=2, layers=2)
    eng = engine(model_dir, tensor_parallel_size=2)
    try:
        [rank1] = children()
        assert eng.runner.ranks is not None and eng.runner.ranks.alive()
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        eng.add_request(make_prompts((9,), seed=1)[0], GREEDY)
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            while eng.has_unfinished:
                eng.step()
        assert time.monotonic() - start < 30  # the step failed; it did not hang
        assert not eng.runner.ranks.alive()
    finally:
        eng.close()
    assert children() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_ranks_on_cuda_equal_transformers(make_tiny):
    """NCCL with a GPU per rank; with one GPU both ranks share it (gloo through host memory).
    Run by scripts/gpu_check.sh."""
    model_dir = make_tiny("llama", heads=4, kv_heads=2, layers=2)
    prompts = make_prompts((1, 6, 17, 40), seed=3)
    want = [hf_greedy_on(hf_model(model_dir, torch.float32), p, NEW_TOKENS) for p in prompts]
    got, _ = greedy(model_dir, prompts, tensor_parallel_size=2, device="cuda")
    assert got == want
    assert children() == []
