"""Decode benchmark: `DecodeEngine` vs transformers `generate()`, and swap vs a plain memcpy.

    python -m pagedserve.bench.decode [--model DIR] [--device cpu|cuda] [--reps 3] [--out FILE]
    pagedserve bench decode ...

1. **Decode tokens/s** at batch 1, 16, 64 (same prompts, `--prompt-len` tokens each, exactly
   `--new-tokens` greedy tokens, EOS ignored). For both engines the decode time is
   `t(new_tokens) - t(1)`: a full run minus a run that stops after the first token (the faster
   of two), so the prefill is not counted. Ours: `DecodeEngine.generate` (prefix caching off,
   so every run computes its prompts). Peer: `model.generate(do_sample=False)`, unpadded.
2. **Swap GB/s**: the `Swapper` moving `--swap-blocks` blocks device -> host and back, in
   scattered (shuffled) block order, timed to completion, vs one `copy_` of the same bytes
   between two contiguous tensors (the memcpy probe).

Repetitions are interleaved (ours, peer, ours, peer, ...); the table gives the median and the
min-max spread, and each ratio is taken per repetition. Without `--model`, a tiny random Llama
(4 layers, hidden 256, fp32) is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pagedserve.bench.decode_step import model_or_tiny
from pagedserve.decode_worker.engine import DecodeEngine, DecodeEngineConfig
from pagedserve.decode_worker.swapper import Swapper
from pagedserve.kvstore.kv_cache import KVCache
from pagedserve.kvstore.swap_space import SwapSpace
from pagedserve.sampling_params import SamplingParams

BATCHES = (1, 16, 64)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


# -- decode tokens/s --------------------------------------------------------------------------


class Ours:
    def __init__(self, model_dir: str, args: argparse.Namespace, batch: int) -> None:
        blocks = batch * (-(-(args.prompt_len + args.new_tokens) // args.block_size) + 1)
        config = DecodeEngineConfig(
            block_size=args.block_size,
            num_blocks=blocks,
            max_num_batched_tokens=max(2048, batch * args.prompt_len),
            max_num_seqs=batch,
            enable_prefix_caching=False,
            num_swap_blocks=0,
            device=args.device,
        )
        self.engine = DecodeEngine.from_model_dir(model_dir, config)

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        seqs = self.engine.generate(prompts, params)
        assert all(s.num_output_tokens == new_tokens for s in seqs)


class HF:
    def __init__(self, model_dir: str, device: str) -> None:
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(device).eval()
        self.device = device

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts, device=self.device)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == ids.shape[1] + new_tokens


def decode_rate(engine: Ours | HF, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Decode tokens/s: (t(new_tokens) - t(1)) over the tokens after the first."""
    full = _timed(partial(engine.run, prompts, args.new_tokens), args.device)
    # NOTE: the faster of two prefill-only runs: noise here is subtracted
    first = min(_timed(partial(engine.run, prompts, 1), args.device) for _ in range(2))
    return len(prompts) * (args.new_tokens - 1) / max(full - first, 1e-9)


def bench_decode(model_dir: str, args: argparse.Namespace) -> list[dict]:
    hf = HF(model_dir, args.device)
    rows = []
    rng = random.Random(0)
    for batch in args.batches:
        ours = Ours(model_dir, args, batch)
        prompts = [[rng.randrange(3, 500) for _ in range(args.prompt_len)] for _ in range(batch)]
        ours.run(prompts, 2)  # warm-up
        hf.run(prompts, 2)
        samples: dict[str, list[float]] = {"ours": [], "hf": []}
        for _ in range(args.reps):
            samples["ours"].append(decode_rate(ours, prompts, args))
            samples["hf"].append(decode_rate(hf, prompts, args))
        ours.engine.close()
        ratios = [o / h for o, h in zip(samples["ours"], samples["hf"], strict=True)]
        rows.append({"batch": batch, **samples, "ratio": ratios})
        print(
            f"batch {batch}: ours {_summary(samples['ours'])} tok/s, hf {_summary(samples['hf'])}"
        )
    return rows


# -- swap GB/s ---------------------------------------------------------------------------------


def bench_swap(model_dir: str, args: argparse.Namespace) -> dict:
    from pagedserve.model.config import load_model_config
    from pagedserve.model.runner import kv_cache_spec

    spec = kv_cache_spec(load_model_config(model_dir), args.block_size)
    n = args.swap_blocks
    device_cache = KVCache(spec, n + 1, args.device)
    device_cache.tensor.normal_()
    host = SwapSpace(spec, n)
    swapper = Swapper(device_cache.tensor, host.tensor)
    nbytes = n * spec.bytes_per_block
    src = device_cache.tensor[:n].contiguous()
    dst = torch.empty_like(host.tensor)
    device_ids, host_ids = list(range(n)), list(range(n))
    random.Random(1).shuffle(device_ids)
    out_pairs = list(zip(device_ids, host_ids, strict=True))
    in_pairs = [(h, d) for d, h in out_pairs]

    def swap_out() -> None:
        swapper.submit([], out_pairs)
        swapper.synchronize()

    def swap_in() -> None:
        swapper.submit(in_pairs, [])
        swapper.synchronize()

    samples: dict[str, list[float]] = {"swap_out": [], "swap_in": [], "memcpy": []}
    swap_out()  # warm-up
    swap_in()
    dst.copy_(src)
    for _ in range(args.reps):
        samples["swap_out"].append(nbytes / _timed(swap_out, args.device) / 1e9)
        samples["swap_in"].append(nbytes / _timed(swap_in, args.device) / 1e9)
        samples["memcpy"].append(nbytes / _timed(lambda: dst.copy_(src), args.device) / 1e9)
    swapper.close()
    assert torch.equal(host.tensor[host_ids[0]], device_cache.tensor[device_ids[0]].cpu())
    return {"blocks": n, "bytes": nbytes, "pinned": host.is_pinned, **samples}


# -- report ------------------------------------------------------------------------------------


def markdown(decode_rows: list[dict], swap: dict, args: argparse.Namespace) -> str:
    lines = [
        f"Decode tokens/s (prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"{args.reps} interleaved reps; median (min-max)):",
        "",
        "| batch | DecodeEngine tok/s | transformers generate() tok/s | ours / HF |",
        "|---|---|---|---|",
    ]
    for row in decode_rows:
        lines.append(
            f"| {row['batch']} | {_summary(row['ours'])} | {_summary(row['hf'])} | "
            f"{_ratio(row['ratio'])} |"
        )
    mib = swap["bytes"] / 2**20
    pinned = "pinned" if swap["pinned"] else "pageable"
    lines += [
        "",
        f"Swap: {swap['blocks']} blocks ({mib:.0f} MiB, shuffled order, {pinned} host memory), "
        "GB/s:",
        "",
        "| swap out | swap in | memcpy probe | swap out / memcpy | swap in / memcpy |",
        "|---|---|---|---|---|",
    ]
    out_r = [o / m for o, m in zip(swap["swap_out"], swap["memcpy"], strict=True)]
    in_r = [i / m for i, m in zip(swap["swap_in"], swap["memcpy"], strict=True)]
    lines.append(
        f"| {_summary(swap['swap_out'])} | {_summary(swap['swap_in'])} | "
        f"{_summary(swap['memcpy'])} | {_ratio(out_r)} | {_ratio(in_r)} |"
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedserve bench decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny 4-layer Llama)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--swap-blocks", type=int, default=1024)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.reps < 3:
        p.error("--reps: at least 3 (docs/benchmarks/method.md)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_or_tiny(args.model, tmp)
        machine = f"{platform.node()} {platform.processor()} torch {torch.__version__}"
        print(f"# {machine} threads {torch.get_num_threads()} device {args.device}")
        decode_rows = [] if args.skip_decode else bench_decode(model_dir, args)
        swap = bench_swap(model_dir, args)
    print(markdown(decode_rows, swap, args))
    if args.out:
        Path(args.out).write_text(json.dumps({"decode": decode_rows, "swap": swap}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
