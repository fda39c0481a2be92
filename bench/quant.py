"""Quantization side by side: memory, decode speed and accuracy per mode, in one run.

    python -m pagedserve.bench.quant [--model DIR] [--modes fp32 bf16 int8 int4 fp32+kv-int8]
                                     [--batches 1 16 64] [--memory 1GiB] [--context 1024]
    pagedserve bench quant ...

Per mode (fp32 and bf16 weights; int8 and int4 weight-only, activations in fp32; `+kv-int8` /
`+kv-fp8`: the same with an 8-bit KV cache):
- **memory**: weight bytes, KV bytes per sequence of `--context` tokens, how many such
  sequences fit in `--memory` beside the weights, and how many fit in a fixed KV budget
  (`--kv-budget`) against the mode without `+kv-...`;
- **decode**: ms per decode step at each batch size B, all modes' engines alive at once and
  their rounds interleaved, so the machine's noise falls on every mode;
- **accuracy**: perplexity on pagedserve/data/perplexity.txt (an essay written for this
  repository, about 1,700 tokens), computed by transformers on the weights the mode computes
  with (its dequantized weights: the oracle the quantized engine equals token for token,
  tests/model/test_quant.py), and greedy agreement with fp32 over 32 prompts cut from that
  text, run through the decode engine with the packed kernels. An 8-bit KV mode's perplexity
  is the engine's own (one forward over the text, K/V read back through the cache; its token
  oracle is in tests/model/test_kv8_oracle.py), and beside it the engine's perplexity with
  every token computed in its own decode step (`--decode-tokens` of the text), both also for
  the mode it is compared with, which is how generated tokens meet the cache.

Without `--model`, a tiny random Llama (4 layers, hidden 256) is used: its perplexity means
nothing, its speed and memory do.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from pagedserve.bench.decode_step import decoding_engine, model_or_tiny
from pagedserve.cli_options import parse_bytes
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.model.config import load_model_config
from pagedserve.model.quant import WeightQuant, dequantize_into
from pagedserve.model.runner import kv_cache_spec, weight_bytes
from pagedserve.sampling_params import SamplingParams

WEIGHT_MODES = ("fp32", "bf16", "bf16-int8", "bf16-int4", "int8", "int4", "w8a8")
MODES = (*WEIGHT_MODES, "fp32+kv-int8", "fp32+kv-fp8", "bf16+kv-int8")
KV_NAMES = {"int8": "int8", "fp8": "fp8_e4m3"}


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    dtype: str
    quant: WeightQuant | None
    kv: str | None = None  # --kv-cache-dtype of an 8-bit KV mode
    base: str = ""  # for an 8-bit KV mode: the mode it is compared with (model-dtype KV)


def mode_choice(text: str) -> str:
    weights, _, kv = text.partition("+kv-")
    if weights not in WEIGHT_MODES or (kv and kv not in KV_NAMES):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected one of {WEIGHT_MODES}, optionally with +kv-int8 or +kv-fp8"
        )
    return text


def mode(name: str, group_size: int = 32) -> Mode:
    """fp32 / bf16: the model's dtype; int8 / int4: quantized weights with fp32 activations;
    w8a8: int8 weights and per-token int8 activations;
    bf16-int8 / bf16-int4: with bf16 activations (ATen's packed kernels); `+kv-int8` or
    `+kv-fp8` after any of them: an 8-bit KV cache."""
    weights, _, kv = name.partition("+kv-")
    if kv:
        base = mode(weights, group_size)
        return Mode(f"{base.name}+kv-{kv}", base.dtype, base.quant, KV_NAMES[kv], base.name)
    name = weights
    dtype, _, method = name.rpartition("-") if "-" in name else ("fp32", "", name)
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    if method in ("fp32", "bf16"):
        return Mode(name, {"fp32": "float32", "bf16": "bfloat16"}[method], None)
    quant = WeightQuant(method, group_size)
    label = f"{name}-g{group_size}" if method == "int4" else name
    return Mode(label, dtype, quant)


def corpus() -> str:
    return resources.files("pagedserve").joinpath("data/perplexity.txt").read_text()


def hf_model(model_dir: str, m: Mode):
    """transformers' model computing with this mode's weights (quantized ones dequantized)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, m.dtype)).eval()
    return model if m.quant is None else dequantize_into(model, m.quant)


def perplexity(model_dir: str, m: Mode, token_ids: list[int]) -> float:
    """exp(mean next-token negative log-likelihood) over the whole text, one forward."""
    model = hf_model(model_dir, m)
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="mean")
    return math.exp(nll.item())


def engine_perplexity(model_dir: str, m: Mode, token_ids: list[int], chunk: int) -> float:
    """exp(mean NLL) of the text computed by our model over its paged cache, `chunk` tokens
    per forward (1: every token in its own decode step; len: one forward)."""
    from pagedserve.kernels.dispatch import AttentionMetadata
    from pagedserve.model.loader import load_model
    from pagedserve.model.runner import ModelRunner

    config = load_model_config(model_dir, m.dtype, m.quant, m.kv)
    model = load_model(config, "cpu")
    token_ids = token_ids[: config.max_position_embeddings]
    block_size, n = 16, len(token_ids)
    runner = ModelRunner(config, model, -(-n // block_size), block_size)
    table = torch.arange(runner.kv_cache.num_blocks)[None]  # block i holds positions 16i..
    total = 0.0
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        positions = torch.arange(start, end)
        meta = AttentionMetadata(
            slot_mapping=positions, block_tables=table, query_lens=[end - start], seq_lens=[end]
        )
        hidden = model(torch.tensor(token_ids[start:end]), positions, runner.kv_cache, meta)
        logits = model.compute_logits(hidden).float()
        target = torch.tensor(token_ids[start + 1 : end + 1])
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
    return math.exp(total / (n - 1))


def prompts_from(token_ids: list[int], count: int = 32, length: int = 48) -> list[list[int]]:
    """`count` windows of `length` tokens, evenly spaced over the text."""
    stride = max(1, (len(token_ids) - length) // count)
    return [token_ids[i * stride : i * stride + length] for i in range(count)]


def greedy(model_dir: str, m: Mode, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy outputs through the decode engine (the packed kernels), all prompts batched."""
    longest = max(map(len, prompts)) + new_tokens
    config = DecodeEngineConfig(
        block_size=16,
        num_blocks=len(prompts) * (-(-longest // 16) + 1),
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
        num_swap_blocks=0,
        dtype=m.dtype,
        quantization=m.quant,
        kv_cache_dtype=m.kv,
    )
    engine = DecodeEngine.from_model_dir(model_dir, config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        return [s.output_token_ids for s in engine.generate(prompts, params)]
    finally:
        engine.close()


def agreement(outs: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(fraction of prompts whose outputs equal the reference's, mean fraction of tokens
    before the first difference)."""
    same = sum(a == b for a, b in zip(outs, ref, strict=True))
    prefix = []
    for a, b in zip(outs, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        prefix.append(n / len(b))
    return same / len(ref), statistics.mean(prefix)


def step_ms(
    model_dir: str, modes: list[Mode], batch: int, rounds: int, steps: int
) -> dict[str, list[float]]:
    """Milliseconds per decode step of B sequences, per round, each mode's engine alive at
    once and the rounds interleaved."""
    max_tokens = 2 + rounds * (steps + 1)
    engines = {
        m.name: decoding_engine(
            model_dir, batch, max_tokens, dtype=m.dtype, quantization=m.quant, kv_cache_dtype=m.kv
        )
        for m in modes
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for _ in range(rounds):
            for name, engine in engines.items():
                engine.step()
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                times[name].append((time.perf_counter() - start) / steps * 1e3)
    finally:
        for engine in engines.values():
            engine.close()
    return times


def memory(model_dir: str, m: Mode, budget: int, kv_budget: int, context: int) -> dict:
    config = load_model_config(model_dir, m.dtype, m.quant, m.kv)
    spec = kv_cache_spec(config, 16)
    per_seq = spec.bytes_per_block * -(-context // 16)
    weights = weight_bytes(config)
    return {
        "weight_bytes": weights,
        "kv_bytes_per_seq": per_seq,
        "max_seqs": max(0, (budget - weights) // per_seq),
        "kv_budget_seqs": kv_budget // per_seq,
    }


def accuracy(args: argparse.Namespace, model_dir: str, modes: list[Mode], report: dict) -> None:
    """Each mode's perplexity (and decode-order perplexity for 8-bit KV) and greedy agreement
    with the first mode, into `report`."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(corpus())["input_ids"]
    report["corpus_tokens"] = len(ids)
    report["decode_tokens"] = min(len(ids), args.decode_tokens)
    prompts = prompts_from(ids)
    ref = None
    head = ids[: report["decode_tokens"]]
    engine_ppl: dict[tuple[str, int], float] = {}  # (mode, chunk): each computed once

    def engine_ppl_of(m: Mode, text: list[int], chunk: int) -> float:
        if (m.name, chunk) not in engine_ppl:
            engine_ppl[m.name, chunk] = engine_perplexity(model_dir, m, text, chunk)
        return engine_ppl[m.name, chunk]

    for m in modes:
        entry = report["modes"][m.name]
        if m.kv:  # against the engine on the base mode's weights, computed the same way
            base = mode(m.base, args.group_size)
            entry["perplexity"] = engine_ppl_of(m, ids, len(ids))
            entry["base_perplexity"] = engine_ppl_of(base, ids, len(ids))
            entry["decode_perplexity"] = engine_ppl_of(m, head, 1)
            entry["base_decode_perplexity"] = engine_ppl_of(base, head, 1)
            if base.name in report["modes"]:
                report["modes"][base.name]["decode_perplexity"] = entry["base_decode_perplexity"]
        elif m.quant is not None and m.quant.method == "w8a8":
            # NOTE: transformers cannot compute int8 activations: the engine's own, one forward
            entry["perplexity"] = engine_ppl_of(m, ids, len(ids))
        else:
            entry["perplexity"] = perplexity(model_dir, m, ids)
        outs = greedy(model_dir, m, prompts, args.new_tokens)
        ref = outs if ref is None else ref
        entry["greedy_same"], entry["greedy_prefix"] = agreement(outs, ref)


def run(args: argparse.Namespace, model_dir: str) -> dict:
    modes = [mode(name, args.group_size) for name in args.modes]
    report: dict = {"model": model_dir, "threads": torch.get_num_threads(), "modes": {}}
    budget, kv_budget = parse_bytes(args.memory), parse_bytes(args.kv_budget)
    report["kv_budget_bytes"] = kv_budget
    for m in modes:
        entry = memory(model_dir, m, budget, kv_budget, args.context)
        if m.kv:
            base = memory(model_dir, mode(m.base, args.group_size), budget, kv_budget, args.context)
            entry["kv_budget_seqs_vs_base"] = entry["kv_budget_seqs"] / base["kv_budget_seqs"]
        report["modes"][m.name] = entry
    if not args.no_accuracy:
        accuracy(args, model_dir, modes, report)
    for batch in args.batches:
        times = step_ms(model_dir, modes, batch, args.rounds, args.steps)
        for name, ms in times.items():
            report["modes"][name][f"step_ms_b{batch}"] = ms
    return report


def table(report: dict, batches: list[int]) -> str:
    modes = report["modes"]
    base = next(iter(modes.values()))
    head = ("| mode | weights MiB | KV MiB / seq | max seqs | seqs in KV budget (x base) "
            "| perplexity | decode-order ppl | greedy = first (prefix) |")  # fmt: skip
    head += "".join(f" B={b} ms/step (x first) |" for b in batches)
    lines = [head, "|" + "---|" * (8 + len(batches))]
    for name, e in modes.items():
        ppl = f"{e['perplexity']:.3f}" if "perplexity" in e else "-"
        ppl_decode = f"{e['decode_perplexity']:.3f}" if "decode_perplexity" in e else "-"
        if "base_perplexity" in e:
            ppl += f" (base {e['base_perplexity']:.3f})"
            ppl_decode += f" (base {e['base_decode_perplexity']:.3f})"
        agree = f"{e['greedy_same']:.2f} ({e['greedy_prefix']:.2f})" if "greedy_same" in e else "-"
        seqs = str(e["kv_budget_seqs"])
        if "kv_budget_seqs_vs_base" in e:
            seqs += f" ({e['kv_budget_seqs_vs_base']:.2f}x)"
        row = (f"| {name} | {e['weight_bytes'] / 2**20:.1f} | {e['kv_bytes_per_seq'] / 2**20:.2f} "
               f"| {e['max_seqs']} | {seqs} | {ppl} | {ppl_decode} | {agree} |")  # fmt: skip
        for b in batches:
            ms = statistics.median(e[f"step_ms_b{b}"])
            ref = statistics.median(base[f"step_ms_b{b}"])
            row += f" {ms:.1f} ({ref / ms:.2f}x) |"
        lines.append(row)
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedserve bench quant", description=__doc__)
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny 4-layer Llama)")
    p.add_argument(
        "--modes", nargs="+", default=list(MODES), type=mode_choice, metavar="MODE",
        help=f"of {WEIGHT_MODES}, each optionally +kv-int8 or +kv-fp8 (default: {MODES})",
    )  # fmt: skip
    p.add_argument("--group-size", type=int, default=32, help="int4's")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--memory", default="1GiB", help="weights + KV budget for max seqs")
    p.add_argument("--kv-budget", default="256MiB", help="KV bytes for the sequence count")
    p.add_argument("--context", type=int, default=1024, help="tokens per sequence for memory")
    p.add_argument(
        "--decode-tokens", type=int, default=384,
        help="8-bit KV: tokens of the text for the decode-order perplexity (one step each)",
    )  # fmt: skip
    p.add_argument("--new-tokens", type=int, default=32, help="greedy agreement's outputs")
    p.add_argument("--no-accuracy", action="store_true", help="skip perplexity and agreement")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_or_tiny(args.model, tmp)
        report = run(args, model_dir)
    print(f"# {report['model']}, torch {torch.__version__}, {report['threads']} threads")
    print(table(report, args.batches))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
