"""Structured output's price: decode steps of B requests under a JSON schema against B without.

    python -m pagedserve.bench.structured [--model DIR] [--batches 1 16] [--rounds 5]
    pagedserve bench structured ...

Two `DecodeEngine`s on the same weights: one runs B greedy requests constrained by a JSON schema
(an object with a list of at least 60 short lowercase strings, so no request can finish within
the bench), the other the same prompts unconstrained (`ignore_eos`). Once all are decoding,
rounds alternate between them, each timing `--steps` steps after one untimed step; the output
is ms per step and the constrained rate over the unconstrained one (per-round spread), the
issue's goal being >= 0.9 at 16 streams. What is timed is the whole step: the matchers' catch-up,
the bitmask fill (one call for the batch), the mask on the logits, the forward pass. Compiling
the schema happens once, before (docs/structured_output.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence

import torch

from pagedserve.bench.decode_step import decoding_engine, model_or_tiny
from pagedserve.decode_worker.engine import DecodeEngine
from pagedserve.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
            "minItems": 60,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def engine_with(model_dir: str, batch: int, max_tokens: int, grammar: bool) -> DecodeEngine:
    """decode_step's engine (the same prompts for both arms), constrained by SCHEMA when
    `grammar`."""
    params = None
    if grammar:
        spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=spec)
    return decoding_engine(model_dir, batch, max_tokens, params)


def step_times(model_dir: str, batch: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Milliseconds per decode step, per round, in each arm."""
    max_tokens = 2 + args.rounds * (args.steps + 1)
    engines = {arm: engine_with(model_dir, batch, max_tokens, arm == "schema")
               for arm in ("plain", "schema")}  # fmt: skip
    times: dict[str, list[float]] = {arm: [] for arm in engines}
    try:
        for _ in range(args.rounds):
            for arm, engine in engines.items():
                engine.step()
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                times[arm].append((time.perf_counter() - start) / args.steps * 1e3)
        for arm, engine in engines.items():
            assert engine.has_unfinished, f"{arm}: a request finished inside the bench"
    finally:
        for engine in engines.values():
            engine.close()
    return times


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedserve bench structured", description=__doc__)
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny 4-layer Llama)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_or_tiny(args.model, tmp)
        print(f"# {model_dir}, torch {torch.__version__}, {torch.get_num_threads()} threads")
        print("| B | unconstrained ms/step | JSON schema ms/step | schema rate / plain rate |")
        print("|---|---|---|---|")
        for batch in args.batches:
            times = step_times(model_dir, batch, args)
            per_round = [a / b for a, b in zip(times["plain"], times["schema"], strict=True)]
            plain, schema = (statistics.median(times[arm]) for arm in ("plain", "schema"))
            print(f"| {batch} | {plain:.1f} | {schema:.1f} | {plain / schema:.2f} "
                  f"({min(per_round):.2f}-{max(per_round):.2f}) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
