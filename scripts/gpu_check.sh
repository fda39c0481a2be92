#!/usr/bin/env bash
# One prepared check for a CUDA machine (docs/kernels.md), under 5 minutes on one H100/H200:
#   1. find or create a virtualenv and install pagedserve (.[dev]) into it, keeping whatever
#      CUDA torch is already installed;
#   2. run the kernel tests and the tensor-parallel CUDA test on CUDA (natively compiled Triton,
#      no TRITON_INTERPRET);
#   3. micro-benchmark paged decode attention vs contiguous SDPA on the same K/V, with the
#      achieved bandwidth against a copy probe, as a Markdown table.
# Output: $OUT/gpu_check.md (and the logs) when OUT is set, else docs/gpu_check.md.
#   usage: scripts/gpu_check.sh            (from anywhere; it cds to the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
DEST=${OUT:-docs}
mkdir -p "$DEST"
REPORT="$DEST/gpu_check.md"
LOG="$DEST/gpu_check.log"
: >"$LOG"

say() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
  say "nvidia-smi missing or failing: this script needs a CUDA machine"
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"

# --- 1. environment -------------------------------------------------------------------------
PY=""
for cand in .venv/bin/python python3; do
  if command -v "$cand" >/dev/null 2>&1 &&
    "$cand" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=$cand
    break
  fi
done
if [ -z "$PY" ]; then
  # NOTE: --system-site-packages keeps a CUDA torch installed system-wide (typical GPU images).
  say "no python with CUDA torch found in .venv; creating .venv-gpu"
  python3 -m venv --system-site-packages .venv-gpu
  PY=.venv-gpu/bin/python
fi
say "python: $PY"
"$PY" -m pip install --disable-pip-version-check -q -e ".[dev]" 2>&1 | tail -5 | tee -a "$LOG"
"$PY" - <<'EOF' | tee -a "$LOG"
import torch, triton
assert torch.cuda.is_available(), "torch has no CUDA: install a CUDA build of torch first"
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      torch.cuda.get_device_name())
EOF

# --- 2. kernel tests on CUDA ------------------------------------------------------------------
unset TRITON_INTERPRET
say "kernel tests on CUDA"
set +e
# NOTE: and tensor parallelism on CUDA (NCCL with a GPU per rank; on one GPU, gloo through host
# memory with both ranks on it)
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/kernels \
  tests/model/test_tensor_parallel.py -k "cuda or kernels" 2>&1 | tee "$DEST/gpu_tests.log" | tail -15
TEST_RC=${PIPESTATUS[0]}
set -e
TEST_LINE=$(tail -1 "$DEST/gpu_tests.log")
say "tests rc=$TEST_RC: $TEST_LINE"

# --- 3. micro-benchmark ---------------------------------------------------------------------
say "benchmark"
set +e
timeout 120 "$PY" -m pagedserve.bench.kernels --device cuda --reps 5 --dtype bfloat16 \
  --out "$DEST/gpu_bench.md" 2>>"$LOG" >/dev/null
BENCH_RC=$?
set -e
say "benchmark rc=$BENCH_RC"

{
  echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)."
  echo "Kernel tests on CUDA (rc=$TEST_RC): \`$TEST_LINE\`"
  echo
  if [ -f "$DEST/gpu_bench.md" ]; then cat "$DEST/gpu_bench.md"; else echo "benchmark failed (rc=$BENCH_RC)"; fi
  echo
  echo "Goal (issue 3): paged ÷ sdpa ≤ 1.25, ≥ 60 % of the copy bandwidth at batch 64."
} >"$REPORT"
cat "$REPORT"
say "done in $(($(date +%s) - START))s; report $REPORT"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
