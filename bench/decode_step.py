"""Decode step A/B/C: the torch path, the native CPU kernels layer by layer, and the native stack
(every layer in one call, model/native_stack.py), in one engine.

    python -m pagedserve.bench.decode_step [--model DIR] [--batches 1 16 48] [--rounds 4]
        [--dtype float32|bfloat16]
    pagedserve bench decode-step ...

One `DecodeEngine` per batch size runs B greedy requests (prompts of 32-255 random tokens);
once all are decoding, rounds cycle through the three arms (`cpu_native.enabled`,
`native_stack.enabled`), each timing `--steps` decode steps after one untimed step. Every arm
sees the same engine, weights, batch and (nearly) the same context lengths, so the ratios are
what the kernels change; the machine's noise falls on all of them. Without `--model`, a tiny
random Llama (4 layers, hidden 256) is used.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.kernels import cpu_native
from pagedserve.model import native_stack
from pagedserve.model.quant import weight_quant_from_args
from pagedserve.sampling_params import SamplingParams


def model_or_tiny(model_dir: str | None, scratch: str) -> str:
    """`model_dir`, or a tiny random Llama (4 layers, hidden 256) written to `scratch`."""
    if model_dir is not None:
        return model_dir
    from pagedserve.tiny_model import make_tiny_model

    return str(make_tiny_model(scratch, layers=4, hidden=256, heads=4, kv_heads=2))


def decoding_engine(
    model_dir: str,
    batch: int,
    max_tokens: int,
    params: SamplingParams | None = None,
    **config: Any,
) -> DecodeEngine:
    """An engine with `batch` greedy requests (prompts of 32-255 random tokens, the same for
    every call) all past their prefill, each with room for `max_tokens` outputs (`params`:
    theirs, else greedy with ignore_eos)."""
    engine = DecodeEngine.from_model_dir(
        model_dir,
        DecodeEngineConfig(
            block_size=16,
            num_blocks=batch * (-(-(256 + max_tokens) // 16) + 1),
            max_num_batched_tokens=8192,
            max_num_seqs=batch,
            enable_prefix_caching=False,
            num_swap_blocks=0,
            **config,
        ),
    )
    rng = random.Random(0)
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [
        engine.add_request([rng.randrange(3, 500) for _ in range(rng.randrange(32, 256))], params)
        for _ in range(batch)
    ]
    while not all(s.num_output_tokens >= 1 for s in seqs):  # every prompt prefilled
        engine.step()
    return engine


ARMS = {"torch": (False, False), "native": (True, False), "stack": (True, True)}
"""arm -> (`cpu_native.enabled`, `native_stack.enabled`)"""


def step_times(model_dir: str, batch: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Milliseconds per decode step, per round, in each arm."""
    rounds, steps = args.rounds, args.steps
    max_tokens = 2 + len(ARMS) * rounds * (steps + 1)
    engine = decoding_engine(model_dir, batch, max_tokens, dtype=args.dtype,
                             quantization=weight_quant_from_args(args))  # fmt: skip
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    try:
        for _ in range(rounds):
            for arm, (kernels, stack) in ARMS.items():
                cpu_native.enabled, native_stack.enabled = kernels, stack
                engine.step()
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[arm].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        cpu_native.enabled = native_stack.enabled = True
        engine.close()
    return times


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedserve bench decode-step", description=__doc__)
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny 4-layer Llama)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 48])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: the checkpoint's"
    )
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="the linear layers' weights (default: the dtype's)")  # fmt: skip
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization: the LM head in int8 too")  # fmt: skip
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    reason = cpu_native.unavailable_reason()
    if reason is not None:
        print(f"the native kernel is unavailable here: {reason}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_or_tiny(args.model, tmp)
        print(f"# {model_dir} ({args.dtype or 'its dtype'}), torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")  # fmt: skip
        print("| B | torch path ms/step | native kernels ms/step | native stack ms/step | "
              "torch / native | native / stack |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for batch in args.batches:
            times = step_times(model_dir, batch, args)
            ms = {arm: statistics.median(t) for arm, t in times.items()}
            print(
                f"| {batch} | {ms['torch']:.1f} | {ms['native']:.1f} | {ms['stack']:.1f} | "
                f"{_ratio(times, 'torch', 'native')} | {_ratio(times, 'native', 'stack')} |"
            )
    return 0


def _ratio(times: dict[str, list[float]], slow: str, fast: str) -> str:
    """median(slow) / median(fast), and the spread of the per-round ratios."""
    per_round = [a / b for a, b in zip(times[slow], times[fast], strict=True)]
    ratio = statistics.median(times[slow]) / statistics.median(times[fast])
    return f"{ratio:.2f} ({min(per_round):.2f}-{max(per_round):.2f})"


if __name__ == "__main__":
    raise SystemExit(main())
