"""Decode step A/B: the native CPU attention kernel against the torch path, in one engine.

    python -m pagedserve.bench.decode_step [--model DIR] [--batches 1 16 48] [--rounds 4]
        [--dtype float32|bfloat16]
    pagedserve bench decode-step ...

One `DecodeEngine` per batch size runs B greedy requests (prompts of 32-255 random tokens);
once all are decoding, rounds alternate `cpu_native.enabled` on and off, each timing
`--steps` decode steps after one untimed step. Both arms see the same engine, weights, batch
and (nearly) the same context lengths, so the ratio is what the kernel changes; the machine's
noise falls on both. Without `--model`, a tiny random Llama (4 layers, hidden 256) is used.
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
from pagedserve.sampling_params import SamplingParams


def model_or_tiny(model_dir: str | None, scratch: str) -> str:
    """`model_dir`, or a tiny random Llama (4 layers, hidden 256) written to `scratch`."""
    if model_dir is not None:
        return model_dir
    from pagedserve.tiny_model import make_tiny_model

    return str(make_tiny_model(scratch, layers=4, hidden=256, heads=4, kv_heads=2))


def decoding_engine(model_dir: str, batch: int, max_tokens: int, **config: Any) -> DecodeEngine:
    """An engine with `batch` greedy requests (prompts of 32-255 random tokens, the same for
    every call) all past their prefill, each with room for `max_tokens` outputs."""
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
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [
        engine.add_request([rng.randrange(3, 500) for _ in range(rng.randrange(32, 256))], params)
        for _ in range(batch)
    ]
    while not all(s.num_output_tokens >= 1 for s in seqs):  # every prompt prefilled
        engine.step()
    return engine


def step_times(model_dir: str, batch: int, args: argparse.Namespace) -> dict[bool, list[float]]:
    """Milliseconds per decode step, per round, with the kernel on (True) and off (False)."""
    rounds, steps = args.rounds, args.steps
    engine = decoding_engine(model_dir, batch, 2 + 2 * rounds * (steps + 1), dtype=args.dtype)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(rounds):
            for native in (True, False):
                cpu_native.enabled = native
                engine.step()
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[native].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        cpu_native.enabled = True
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
        print("| B | torch path ms/step | native ms/step | torch / native |")
        print("|---|---|---|---|")
        for batch in args.batches:
            times = step_times(model_dir, batch, args)
            on, off = statistics.median(times[True]), statistics.median(times[False])
            spread = [b / a for a, b in zip(times[True], times[False], strict=True)]
            print(f"| {batch} | {off:.1f} | {on:.1f} | {off / on:.2f} "
                  f"({min(spread):.2f}-{max(spread):.2f}) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
