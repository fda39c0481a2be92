"""The device path on a real CUDA GPU, against transformers' greedy `generate()` on the same GPU.

Run by `scripts/gpu_check.sh` on a machine with an NVIDIA GPU; skipped where torch sees none
(every CI run). What it covers, each on `cuda` with natively compiled Triton kernels:
- the decode engine in fp32 (tokens and logits) and bf16 (tokens, or a difference only where
  transformers' own top-2 logits are a near tie), tiny Llama and, when
  `PAGEDSERVE_GPU_SMOLLM2` names its converted directory, SmolLM2-135M-Instruct;
- preemption by swap (device pool -> pinned host swap space on the swap stream -> back) and by
  recompute under a KV budget of two thirds of the demand;
- a two-worker cluster (prefill + decode worker processes on the one GPU, KV handed over
  between them, and the router) started by `pagedserve up --device cuda`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.client import Client
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.plan import PreemptionMode
from pagedserve.launcher import start_cluster
from pagedserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
NEAR_TIE = 0.25
"""Half precision: a token may differ only where transformers' own top-2 logits are this close."""
PROMPT_LENS = (1, 7, 16, 17, 33, 64, 150)


def prompts_for(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def hf_on_cuda(model_dir: Path, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """(new token ids, per-step logits [steps, vocab] float32 on the CPU)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float().cpu()


def engine_on_cuda(model_dir: Path, **config) -> DecodeEngine:
    config = {"block_size": 16, "num_blocks": 256, "num_swap_blocks": 0, **config}
    return DecodeEngine.from_model_dir(str(model_dir), DecodeEngineConfig(device="cuda", **config))


def run(engine: DecodeEngine, prompts: list[list[int]]) -> list[list[int]]:
    seqs = engine.generate(prompts, GREEDY)
    engine.check_integrity()
    assert engine.pool.num_used == 0, "finished sequences must hold no blocks"
    return [s.output_token_ids for s in seqs]


def assert_equal_or_near_tie(got: list[int], want: list[int], logits: torch.Tensor, what: str):
    step = next((s for s, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if step is None:
        return
    margin = float(logits[step].max() - logits[step][got[step]])
    assert margin <= NEAR_TIE, f"{what}: differs at step {step}, margin {margin:.3f}"
    print(f"{what}: differs at step {step} at a near tie (margin {margin:.3f})")


@pytest.fixture(scope="module")
def tiny(make_tiny) -> Path:
    return make_tiny("llama", layers=4, hidden=128, heads=4, kv_heads=2)


def test_fp32_tokens_and_logits_equal_transformers_on_cuda(tiny):
    engine = engine_on_cuda(tiny, dtype="float32")
    engine.record_logits = True
    prompts = prompts_for(512)
    seqs = engine.generate(prompts, GREEDY)
    engine.check_integrity()
    model = hf_on_cuda(tiny, torch.float32)
    for prompt, seq in zip(prompts, seqs, strict=True):
        want, want_logits = hf_greedy(model, prompt)
        assert seq.output_token_ids == want, f"prompt of {len(prompt)} tokens"
        got_logits = torch.stack(engine.logits[seq.request_id]).float().cpu()
        err = (got_logits - want_logits).abs().max().item()
        assert err < 1e-3, f"prompt of {len(prompt)}: max |logit diff| {err:.2e}"
    engine.close()


def test_bf16_tokens_equal_transformers_or_differ_at_a_near_tie_on_cuda(tiny):
    engine = engine_on_cuda(tiny, dtype="bfloat16")
    prompts = prompts_for(512, seed=1)
    got = run(engine, prompts)
    engine.close()
    model = hf_on_cuda(tiny, torch.bfloat16)
    for prompt, tokens in zip(prompts, got, strict=True):
        want, logits = hf_greedy(model, prompt)
        assert_equal_or_near_tie(tokens, want, logits, f"bf16 prompt of {len(prompt)}")


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
def test_preemption_under_kv_pressure_keeps_every_token_on_cuda(tiny, mode):
    """Demand is ~150 blocks of 4 tokens; the pool has 100, so sequences are preempted."""
    prompts = prompts_for(512, lens=(5, 12, 17, 23, 30, 38, 44, 9, 51, 27), seed=5)
    config = {"block_size": 4, "num_blocks": 100, "preemption_mode": mode}
    engine = engine_on_cuda(tiny, num_swap_blocks=256, **config)
    got = run(engine, prompts)
    stats = engine.stats
    engine.close()
    if mode is PreemptionMode.SWAP:
        assert stats.num_preemptions_swap > 0 and stats.num_swap_in_blocks > 0
    else:
        assert stats.num_preemptions_recompute > 0
    model = hf_on_cuda(tiny, torch.float32)
    assert got == [hf_greedy(model, p)[0] for p in prompts]


def test_prefill_and_decode_worker_processes_on_one_gpu_equal_transformers(tiny, tmp_path):
    args = argparse.Namespace(
        model=str(tiny), host="127.0.0.1", port=0, prefill=1, decode=1, redis_url=None,
        block_size=16, dtype="float32", device="cuda", kv_cache_memory="64MiB",
        start_timeout=180.0, log_dir=None, http_port=None,
    )  # fmt: skip
    prompts = prompts_for(512, lens=(5, 40, 77), seed=7)
    cluster = start_cluster(args, tmp_path)
    try:
        with Client(cluster.router_address) as client:
            got = [
                [t for part in client.generate(p, GREEDY, timeout=120) for t in part.token_ids]
                for p in prompts
            ]
            status = client.status()
    finally:
        cluster.stop()
    model = hf_on_cuda(tiny, torch.float32)
    assert got == [hf_greedy(model, p)[0] for p in prompts]
    held = sum(
        w.load.kv_blocks_total - w.load.kv_blocks_free - w.load.kv_blocks_cached
        for w in status.workers
    )
    assert held == 0, "finished streams must hold no blocks"


SMOLLM2 = os.environ.get("PAGEDSERVE_GPU_SMOLLM2", "")


@pytest.mark.skipif(
    not SMOLLM2, reason="PAGEDSERVE_GPU_SMOLLM2 names no converted SmolLM2 (gpu_check.sh sets it)"
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_greedy_equals_transformers_on_cuda(dtype):
    smollm2 = Path(SMOLLM2)
    torch_dtype = getattr(torch, dtype)
    engine = engine_on_cuda(smollm2, dtype=dtype, num_blocks=512)
    prompts = prompts_for(49152, lens=(3, 17, 64, 200), seed=2)
    got = run(engine, prompts)
    engine.close()
    model = hf_on_cuda(smollm2, torch_dtype)
    for prompt, tokens in zip(prompts, got, strict=True):
        want, logits = hf_greedy(model, prompt)
        if dtype == "float32":
            assert tokens == want, f"fp32 prompt of {len(prompt)} tokens"
        else:
            assert_equal_or_near_tie(tokens, want, logits, f"bf16 prompt of {len(prompt)}")
