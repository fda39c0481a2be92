"""Machine probes taken at the start of every run: memory bandwidth and GEMM FLOP/s.

Bandwidth is the best of a few tries over a buffer far larger than any CPU cache: `copy` counts
bytes read + written by one `copy_`, `read` counts bytes read by a `sum`. GEMM is square
`n x n` products in fp32 and bf16 (2 n^3 FLOP each), in a linear layer's layout (`x @ w.T`, as
`F.linear` runs them): on a CPU without native bf16 (AVX2), torch's bf16 `a @ b` takes a path
12x slower than its `F.linear`, and the probe read 0.32 GFLOP/s where the model's layers run at
15.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from functools import partial

import torch


def _best(fn: Callable[[], object], tries: int) -> float:
    fn()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(mib: int = 256, tries: int = 5) -> dict[str, float]:
    n = mib * 2**20 // 4
    src, dst = torch.rand(n), torch.empty(n)
    nbytes = src.numel() * 4
    copy_s = _best(lambda: dst.copy_(src), tries)
    read_s = _best(lambda: src.sum(), tries)
    return {"copy_GBps": 2 * nbytes / copy_s / 1e9, "read_GBps": nbytes / read_s / 1e9}


def gemm_flops(n: int = 1024, tries: int = 3) -> dict[str, float]:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.rand(n, n, dtype=dtype), torch.rand(n, n, dtype=dtype)
        seconds = _best(partial(torch.nn.functional.linear, a, b), tries)
        out[f"{str(dtype).removeprefix('torch.')}_GFLOPs"] = 2 * n**3 / seconds / 1e9
    return out


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def run_probes(quick: bool = False) -> dict:
    return {
        "machine": machine(),
        "memory": memory_bandwidth(128 if quick else 512),
        "gemm": gemm_flops(1024 if quick else 2048),
    }
