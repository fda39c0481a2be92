"""The batch-1 decode roofline on a GPU, for scripts/gpu_check.sh (docs/gpu.md).

    python scripts/gpu_roofline.py MODEL_DIR DECODE_BENCH_JSON

A decode step at batch 1 reads every weight once, so its floor is the weights' bytes over the
device's read bandwidth. The bandwidth is probed here (a device-to-device copy of 2 GiB, bytes
read + written over the time, the median of 10); the step time is 1 / tok/s at batch 1 from
`python -m pagedserve.bench.decode --out JSON` (ours and transformers' `generate()`). Prints a
Markdown table.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from safetensors import safe_open

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1, "U8": 1}


def weight_bytes(model_dir: Path) -> int:
    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                t = f.get_slice(name)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * DTYPE_BYTES[t.get_dtype()]
    return total


def copy_bandwidth(num_bytes: int = 2 << 30, reps: int = 10) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / statistics.median(times)


def main(model_dir: str, bench_json: str) -> None:
    weights = weight_bytes(Path(model_dir))
    bandwidth = copy_bandwidth()
    floor_s = weights / bandwidth
    rows = json.loads(Path(bench_json).read_text())["decode"]
    print(
        f"Batch-1 roofline: weights {weights / 1e6:.0f} MB, device copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s (read + written), floor {floor_s * 1e3:.3f} ms/step."
    )
    print()
    print("| batch | engine ms/step | transformers ms/step | engine / floor | engine tok/s |")
    print("|---|---|---|---|---|")
    for row in rows:
        ours = statistics.median(row["ours"]) / row["batch"]  # steps/s
        hf = statistics.median(row["hf"]) / row["batch"]
        print(f"| {row['batch']} | {1e3 / ours:.2f} | {1e3 / hf:.2f} | "
              f"{1 / ours / floor_s:.0f}x | {statistics.median(row['ours']):.0f} |")  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:3])
