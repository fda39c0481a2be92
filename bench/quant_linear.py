"""Micro-benchmark of int4 decoder linears with fp32 activations on CPU: the native kernel
(kernels/csrc/linear_i4g.c) against dequantize + `F.linear` (the path before it) and fp32
`F.linear`, over one pass of a model's linears, each layer its own weights.

The kernel is timed twice: through `QuantizedLinear` (the layer path's Python, ~20 us a call)
and called straight through ctypes with its arguments bound beforehand (~2-3 us a call), as the
decode stack calls it from C. The GB/s column is the second's: the kernel's own reading rate.

    python -m pagedserve.bench.quant_linear [--layers 120] [--rows 1 4 16] [--repeats 20]

NOTE: a large last-level cache keeps part of a small model's weights between passes (on a
VM with a 480 MB one, SmolLM2's 30 layers of int4 read faster than memory allows), so the
default is 120 layers of its shapes; `--layers 30` is the model itself.

The default shapes are SmolLM2-135M's (q, k, v, o, gate, up, down per layer). For each number
of rows it prints the best of `--repeats` interleaved passes (the machine may be shared) in
ms, and for the kernel called straight the bytes of codes and pairs per pass in GB/s,
against the machine's read bandwidth (bench/probes.py: a 256 MiB fp32 sum) measured before and
after.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.bench.probes import memory_bandwidth
from pagedserve.kernels import cpu_native
from pagedserve.model.quant import QuantizedLinear, WeightQuant

# (out, in) of SmolLM2-135M's linears: q, k, v, o, gate, up, down
SMOLLM2 = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))


def make_layers(layers: int, group: int) -> list[QuantizedLinear]:
    torch.manual_seed(0)
    out = []
    for _ in range(layers):
        for n, k in SMOLLM2:
            linear = QuantizedLinear(k, n, False, WeightQuant("int4", group))
            linear.load_weight(torch.randn(n, k) * 0.05)
            out.append(linear)
    return out


def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def kernel_calls(
    layers: list[QuantizedLinear], xs: dict[int, torch.Tensor], ys: dict[int, torch.Tensor]
) -> Callable[[], object]:
    """One pass calling csrc/linear_i4g.c straight, every argument bound beforehand: layer
    q's x is xs[its in_features], its output goes to ys[its out_features]."""
    lib, threads = cpu_native.library(), torch.get_num_threads()
    assert lib is not None, cpu_native.unavailable_reason()
    calls = []
    for q in layers:
        n, k, x, y = q.out_features, q.in_features, xs[q.in_features], ys[q.out_features]
        group = k // q.scales.shape[1]
        calls.append((x.data_ptr(), k, q.qweight.data_ptr(), q.scales.data_ptr(), y.data_ptr(), n,
                      x.shape[0], n, k, group, threads))  # fmt: skip
    fn, held = lib.linear_i4g_f32, (layers, xs, ys)  # NOTE: the pointers' tensors stay alive

    def one_pass() -> object:
        assert held
        return [fn(*call) for call in calls]

    return one_pass


def passes(
    layers: list[QuantizedLinear], dense: list[torch.Tensor], rows: int
) -> dict[str, Callable[[], object]]:
    """One pass over every linear per path, for `rows` rows of activations."""
    xs = {k: torch.randn(rows, k) for _, k in SMOLLM2}
    ys = {n: torch.empty(rows, n) for n, _ in SMOLLM2}
    return {
        "kernel": kernel_calls(layers, xs, ys),
        "native": lambda: [q(xs[q.in_features]) for q in layers],
        "dequantize": lambda: [F.linear(xs[q.in_features], q.dequantize()) for q in layers],
        "fp32": lambda: [F.linear(xs[w.shape[1]], w) for w in dense],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=120)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    layers = make_layers(args.layers, args.group)
    dense = [linear.dequantize() for linear in layers]
    read = sum(t.numel() * t.element_size() for q in layers for t in (q.qweight, q.scales))
    threads, load = torch.get_num_threads(), os.getloadavg()[0]
    print(f"{len(layers)} linears, int4-g{args.group}: {read / 2**20:.1f} MiB of codes and "
          f"scales; {threads} threads; load average {load:.2f}")  # fmt: skip
    probe = memory_bandwidth()["read_GBps"]
    print("| rows | kernel ms | GB/s | through QuantizedLinear ms | dequantize + F.linear ms | "
          "fp32 F.linear ms |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    with torch.no_grad():
        for rows in args.rows:
            fns = passes(layers, dense, rows)
            best = {name: min(timed_ms(fn) for _ in range(2)) for name, fn in fns.items()}
            for _ in range(args.repeats):  # NOTE: interleaved, so a busy spell hits every path
                for name, fn in fns.items():
                    if name != "dequantize" or _ % 4 == 0:
                        best[name] = min(best[name], timed_ms(fn))
            kernel, native = best["kernel"], best["native"]
            old, fp32 = best["dequantize"], best["fp32"]
            gbs = read / kernel / 1e6
            print(f"| {rows} | {kernel:.2f} | {gbs:.1f} | {native:.2f} | {old:.1f} | {fp32:.2f} |")
    probe = max(probe, memory_bandwidth()["read_GBps"])
    print(f"read bandwidth (best probe): {probe:.1f} GB/s; load average after: "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
