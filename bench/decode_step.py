"""Decode step A/B/C: the torch path, the native CPU kernels layer by layer, and the native stack
(every layer in one call, model/native_stack.py), in one engine.

    python -m pagedserve.bench.decode_step [--model DIR | --families NAME...]
        [--batches 1 16 48] [--rounds 4] [--dtype float32|bfloat16]
    pagedserve bench decode-step ...

One `DecodeEngine` per batch size runs B greedy requests (prompts of 32-255 random tokens);
once all are decoding, rounds cycle through the three arms (`cpu_native.enabled`,
`native_stack.enabled`), each timing `--steps` decode steps after one untimed step. Every arm
sees the same engine, weights, batch and (nearly) the same context lengths, so the ratios are
what the kernels change; the machine's noise falls on all of them. Without `--model`, a tiny
random Llama (4 layers, hidden 256) is used.

`--families llama qwen3 gemma2 ...` runs one tiny model of each family instead (the same shape:
4 layers, hidden 256, 4 heads, 2 KV heads; `pagedserve make-tiny-model --family`), one table row
per family and batch, with whether the native stack took the family's layer ("declined": its
decode steps take the layer-by-layer path), so a family that falls off the fast path shows.
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


def model_or_tiny(model_dir: str | None, scratch: str, family: str = "llama") -> str:
    """`model_dir`, or a tiny random model of `family` (4 layers, hidden 256) written to
    `scratch`."""
    if model_dir is not None:
        return model_dir
    from pagedserve.tiny_model import make_tiny_model

    return str(make_tiny_model(scratch, arch=family, layers=4, hidden=256, heads=4, kv_heads=2))


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


def step_times(
    model_dir: str, batch: int, args: argparse.Namespace
) -> tuple[dict[str, list[float]], bool]:
    """(milliseconds per decode step, per round, in each arm; whether the native stack took the
    model in its arm)."""
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
        stacked = engine.runner.model._native_stack(engine.runner.kv_cache) is not None
    finally:
        cpu_native.enabled = native_stack.enabled = True
        engine.close()
    return times, stacked


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedserve bench decode-step", description=__doc__)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="HF model dir (default: a tiny Llama)")
    # NOTE: imported here: pagedserve.tiny_model imports transformers (and with it triton)
    from pagedserve.tiny_model import ARCHS

    source.add_argument("--families", nargs="+", default=None, choices=ARCHS, metavar="FAMILY",
                        help=f"a tiny model of each ({', '.join(ARCHS)})")  # fmt: skip
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
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"dtype {args.dtype or 'of the checkpoint'}")  # fmt: skip
    if args.families:
        _family_table(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_or_tiny(args.model, tmp)
        print(f"# {model_dir}")
        print("| B | torch path ms/step | native kernels ms/step | native stack ms/step | "
              "torch / native | native / stack |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for batch in args.batches:
            times, _ = step_times(model_dir, batch, args)
            print(f"| {batch} | {_cells(times)} |")
    return 0


def _family_table(args: argparse.Namespace) -> None:
    print("| family | B | torch path ms/step | native kernels ms/step | native stack ms/step | "
          "torch / native | native / stack | native stack |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for family in args.families:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = model_or_tiny(None, tmp, family)
            for batch in args.batches:
                times, stacked = step_times(model_dir, batch, args)
                taken = "yes" if stacked else "declined"
                print(f"| {family} | {batch} | {_cells(times)} | {taken} |", flush=True)


def _cells(times: dict[str, list[float]]) -> str:
    """The median ms of each arm and the two ratios, as table cells."""
    ms = {arm: statistics.median(t) for arm, t in times.items()}
    return (
        f"{ms['torch']:.1f} | {ms['native']:.1f} | {ms['stack']:.1f} | "
        f"{_ratio(times, 'torch', 'native')} | {_ratio(times, 'native', 'stack')}"
    )


def _ratio(times: dict[str, list[float]], slow: str, fast: str) -> str:
    """median(slow) / median(fast), and the spread of the per-round ratios."""
    per_round = [a / b for a, b in zip(times[slow], times[fast], strict=True)]
    ratio = statistics.median(times[slow]) / statistics.median(times[fast])
    return f"{ratio:.2f} ({min(per_round):.2f}-{max(per_round):.2f})"


if __name__ == "__main__":
    raise SystemExit(main())
