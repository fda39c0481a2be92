"""Kernel micro-benchmark: paged decode attention vs contiguous SDPA on the same K/V.

    python -m pagedserve.bench.kernels [--device cpu|cuda] [--out FILE] [--candidates]
    pagedserve bench kernels ...

For each (batch, context) the same random K/V live twice: in a block-major paged pool (2 layers,
so the per-layer views are strided, shuffled block tables) and contiguously as [B, Hkv, L, D].
Timed, interleaved within each repetition:

    sdpa-gqa     F.scaled_dot_product_attention(q [B,H,1,D], K, V, enable_gqa=True), the call a
                 contiguous-cache engine makes (transformers' sdpa path)
    sdpa-packed  the same K/V with each KV head's query heads packed as query rows (no GQA
                 expansion): the fastest contiguous SDPA we know
    paged        `dispatch.paged_attention`, what the model calls (CPU path or Triton)
    --candidates the CPU candidates that lost (docs/kernels.md)

Ratios are per repetition (paged / baseline of the same repetition); the table gives the median
and the min-max spread. On CUDA it also reports the paged kernel's achieved bandwidth (bytes of
K/V read / time) against a device-to-device copy probe.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.kernels import dispatch, reference

Fn = Callable[[], object]


@dataclass(frozen=True, slots=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


@dataclass(slots=True)
class Workload:
    """One (batch, context) point: paged and contiguous copies of the same K/V."""

    query: torch.Tensor  # [B, H, D]
    k_cache: torch.Tensor  # strided layer view of the pool
    v_cache: torch.Tensor
    meta: dispatch.AttentionMetadata
    key: torch.Tensor  # [B, Hkv, L, D] contiguous
    value: torch.Tensor
    scale: float

    @property
    def kv_bytes(self) -> int:
        return 2 * self.key.numel() * self.key.element_size()


def make_workload(shape: Shape, batch: int, context: int, device: torch.device) -> Workload:
    blocks = -(-context // shape.block_size)
    num_blocks = batch * blocks + 1
    kv = (shape.block_size, shape.num_kv_heads, shape.head_dim)
    pool = torch.randn(num_blocks, 2, 2, *kv, dtype=shape.dtype, device=device)
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    tables = torch.randperm(num_blocks - 1, device=device)[: batch * blocks].view(batch, blocks)
    key = k_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    value = v_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    query = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
    meta = dispatch.AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        block_tables=tables,
        query_lens=[1] * batch,
        seq_lens=[context] * batch,
    )
    return Workload(query, k_cache, v_cache, meta, key, value, shape.head_dim**-0.5)


def baselines(w: Workload) -> dict[str, Fn]:
    batch, num_heads, head_dim = w.query.shape
    num_kv_heads = w.key.shape[1]
    q4 = w.query.unsqueeze(2)
    packed = w.query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    return {
        "sdpa-gqa": lambda: F.scaled_dot_product_attention(
            q4, w.key, w.value, scale=w.scale, enable_gqa=True
        ),
        "sdpa-packed": lambda: F.scaled_dot_product_attention(
            packed, w.key, w.value, scale=w.scale
        ),
        "paged": lambda: dispatch.paged_attention(w.query, w.k_cache, w.v_cache, w.meta, w.scale),
    }


def candidates(w: Workload) -> dict[str, Fn]:
    """The CPU candidates measured against the winner (docs/kernels.md)."""
    args = (w.query, w.k_cache, w.v_cache, w.meta.block_tables, w.meta.seq_lens, w.scale)
    compiled = torch.compile(padded_gather_sdpa, dynamic=True)
    return {
        "reference": lambda: reference.paged_decode_attention(*args),
        "padded-sdpa": lambda: padded_gather_sdpa(*args),
        "blocked": lambda: blocked_online_softmax(*args),
        "compiled": lambda: compiled(*args),
    }


def padded_gather_sdpa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Candidate: one batched gather padded to the longest context, one masked SDPA."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    blocks = -(-max(seq_lens) // block_size)
    ids = block_tables[:, :blocks]
    key = k_cache[ids].flatten(1, 2).transpose(1, 2)
    value = v_cache[ids].flatten(1, 2).transpose(1, 2)
    lens = torch.tensor(seq_lens, device=query.device)
    pos = torch.arange(blocks * block_size, device=query.device)
    mask = (pos[None, :] < lens[:, None])[:, None, None, :]
    packed = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def blocked_online_softmax(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    chunk_blocks: int = 8,
) -> torch.Tensor:
    """Candidate: loop over chunks of block columns with an online softmax (no full gather)."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    q = query.view(batch, num_kv_heads, -1, head_dim) * scale
    lens = torch.tensor(seq_lens, device=query.device)
    m = torch.full((*q.shape[:3], 1), float("-inf"), device=query.device)
    total = torch.zeros_like(m)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=query.device)
    for first in range(0, -(-max(seq_lens) // block_size), chunk_blocks):
        ids = block_tables[:, first : first + chunk_blocks]
        key = k_cache[ids].flatten(1, 2).permute(0, 2, 3, 1)  # [B, Hkv, D, n]
        value = v_cache[ids].flatten(1, 2).transpose(1, 2)  # [B, Hkv, n, D]
        s = torch.matmul(q, key).float()
        pos = first * block_size + torch.arange(s.shape[-1], device=query.device)
        s.masked_fill_(~(pos[None, :] < lens[:, None])[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p, alpha = torch.exp(s - m_new), torch.exp(m - m_new)
        total = total * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p.to(value.dtype), value).float()
        m = m_new
    return (acc / total).to(query.dtype).view(batch, num_heads, head_dim)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Fn, number: int, device: torch.device) -> float:
    """Seconds per call, averaged over `number` back-to-back calls."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(number):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / number


def _calibrate(fn: Fn, device: torch.device, target_s: float) -> int:
    fn()  # warm up (and compile)
    once = _time(fn, 1, device)
    return max(1, min(1000, int(target_s / max(once, 1e-6))))


def measure(fns: dict[str, Fn], reps: int, device: torch.device) -> dict[str, list[float]]:
    """Interleaved repetitions: every function once per repetition, in the same order."""
    target = 0.02 if device.type == "cuda" else 0.05
    numbers = {name: _calibrate(fn, device, target) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_time(fn, numbers[name], device))
    return times


def copy_bandwidth(num_bytes: int, device: torch.device, reps: int) -> float:
    """Bytes/s of a device copy probe (counting read + write) over a buffer of `num_bytes`."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = measure({"copy": lambda: dst.copy_(src)}, reps, device)["copy"]
    return 2 * num_bytes / statistics.median(times)


def _ratio(paged: list[float], base: list[float]) -> str:
    ratios = [p / b for p, b in zip(paged, base, strict=True)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def run_point(shape: Shape, batch: int, context: int, args: argparse.Namespace) -> list[str]:
    """One table row for (batch, context)."""
    device = torch.device(args.device)
    w = make_workload(shape, batch, context, device)
    fns = baselines(w)
    if args.candidates:
        fns |= candidates(w)
    times = measure(fns, args.reps, device)
    paged = times["paged"]
    row = [
        str(batch),
        str(context),
        f"{statistics.median(times['sdpa-gqa']) * 1e3:.3f}",
        f"{statistics.median(times['sdpa-packed']) * 1e3:.3f}",
        f"{statistics.median(paged) * 1e3:.3f}",
        _ratio(paged, times["sdpa-gqa"]),
        _ratio(paged, times["sdpa-packed"]),
    ]
    if device.type == "cuda":
        achieved = w.kv_bytes / statistics.median(paged)
        probe = copy_bandwidth(w.kv_bytes, device, args.reps)
        row += [f"{achieved / 1e9:.0f}", f"{100 * achieved / probe:.0f}%"]
    if args.candidates:
        row += [_ratio(times[name], times["sdpa-gqa"]) for name in candidates(w)]
    return row


def header(args: argparse.Namespace) -> list[str]:
    cols = ["B", "ctx", "sdpa-gqa ms", "sdpa-packed ms", "paged ms"]
    cols += ["paged ÷ sdpa-gqa", "paged ÷ sdpa-packed"]
    if args.device == "cuda":
        cols += ["paged GB/s", "of copy probe"]
    if args.candidates:
        cols += [
            f"{name} ÷ sdpa-gqa" for name in ("reference", "padded-sdpa", "blocked", "compiled")
        ]
    return cols


def machine(args: argparse.Namespace) -> str:
    device = torch.device(args.device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"{name}; torch {torch.__version__}; backend {dispatch.backend_for(device)}"


def markdown(args: argparse.Namespace, rows: list[list[str]]) -> str:
    cols = header(args)
    lines = [
        f"Machine: {machine(args)}. Shape: heads {args.num_heads}, kv heads {args.num_kv_heads}, "
        f"head_dim {args.head_dim}, block {args.block_size}, {args.dtype}; {args.reps} "
        "interleaved repetitions, ratio = median (min-max).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--candidates", action="store_true", help="also time the CPU candidates")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reps < 3:
        raise ValueError(f"--reps: at least 3 interleaved repetitions, got {args.reps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    shape = Shape(
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        args.block_size,
        getattr(torch, args.dtype),
    )
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            rows.append(run_point(shape, batch, context, args))
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    table = markdown(args, rows)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
