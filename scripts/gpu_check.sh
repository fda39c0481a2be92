#!/usr/bin/env bash
# One prepared check for a CUDA machine (docs/gpu.md), about 8 minutes on one H100/H200:
#   1. install pagedserve into the machine's python (it must already hold a CUDA torch and
#      Triton; wheels of the other dependencies may lie in .whl/ when the machine is offline);
#   2. the kernel tests and the tensor-parallel CUDA test on CUDA (natively compiled Triton,
#      no TRITON_INTERPRET);
#   3. tests/gpu: the decode engine's greedy oracle (fp32, bf16 with near-tie margins), swap and
#      recompute preemption, and `pagedserve up --device cuda` (prefill + decode worker processes
#      on the one GPU) against transformers on the same GPU;
#   4. SmolLM2-135M-Instruct, when its GGUF is at $SMOLLM2_GGUF or in .gpu/smollm2.gguf.part*:
#      converted, its greedy oracle on CUDA, and `bench decode` (engine vs transformers tok/s at
#      batch 1 / 16 / 64, swap GB/s vs a copy) with the batch-1 roofline (weight bytes over the
#      measured device copy bandwidth);
#   5. the paged-attention micro-benchmark (paged vs contiguous SDPA).
# Each part has its own time limit; a failing part is recorded and the next one still runs.
# Output: $OUT/gpu_check.md and logs when OUT is set, else under docs/gpu_check/.
#   usage: scripts/gpu_check.sh [setup]   (setup: step 1 only, to warm a machine up)
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
DEST=${OUT:-docs/gpu_check}
mkdir -p "$DEST"
REPORT="$DEST/gpu_check.md"
LOG="$DEST/gpu_check.log"
touch "$LOG"
RESULTS=()

say() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

# part NAME LIMIT_S LOGFILE CMD...: run CMD under a time limit, keep its tail, record its result
part() {
  local name=$1 limit=$2 logfile=$3
  shift 3
  say "$name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$logfile" 2>&1
  local rc=$?
  tail -25 "$logfile" | tee -a "$LOG"
  local last
  last=$(grep -E "passed|failed|error|skipped" "$logfile" | tail -1)
  RESULTS+=("| $name | rc=$rc | $(($(date +%s) - t0)) s | ${last:-see log} |")
  say "$name: rc=$rc"
}

if ! nvidia-smi >/dev/null 2>&1; then
  say "nvidia-smi missing or failing: this script needs a CUDA machine"
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"

# --- 1. environment -------------------------------------------------------------------------
PY=python3
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  # NOTE: an offline machine: the dependencies torch does not bring travel as wheels, installed
  # beside (not over) the machine's own packages.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pagedserve-site .whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
  export PYTHONPATH=/tmp/pagedserve-site
fi
"$PY" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e . 2>&1 |
  tail -3 | tee -a "$LOG"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import grpc, google.protobuf, torch, transformers, triton
assert torch.cuda.is_available(), "torch has no CUDA: install a CUDA build of torch first"
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "transformers", transformers.__version__, "grpcio", grpc.__version__,
      "protobuf", google.protobuf.__version__, torch.cuda.get_device_name())
import pagedserve.decode_worker.engine  # noqa: F401  (the package imports on this machine)
EOF
[ "${1:-}" = setup ] && { say "setup done"; exit 0; }
unset TRITON_INTERPRET

# --- 2. kernel tests, tensor parallelism on CUDA --------------------------------------------
part "kernel + TP tests on CUDA" 150 "$DEST/kernel_tests.log" \
  "$PY" -m pytest -q -p no:cacheprovider tests/kernels tests/model/test_tensor_parallel.py \
  -k "cuda or kernels"

# --- 3. engine oracle, preemption, a cluster on the GPU --------------------------------------
part "tests/gpu (tiny model)" 200 "$DEST/gpu_tests.log" \
  "$PY" -m pytest -q -s -p no:cacheprovider tests/gpu -k "not smollm2"

# --- 4. the real model ----------------------------------------------------------------------
GGUF=${SMOLLM2_GGUF:-}
if [ -z "$GGUF" ] && ls .gpu/smollm2.gguf.part* >/dev/null 2>&1; then
  GGUF=/tmp/smollm2.gguf
  cat .gpu/smollm2.gguf.part* >"$GGUF"
  if [ -f .gpu/smollm2.gguf.sha256 ] &&
    [ "$(sha256sum "$GGUF" | cut -d' ' -f1)" != "$(cat .gpu/smollm2.gguf.sha256)" ]; then
    say "the GGUF's parts do not add up (a part is missing): SmolLM2 not run"
    GGUF=""
  fi
fi
if [ -n "$GGUF" ]; then
  SMOLLM2=/tmp/smollm2-hf
  part "SmolLM2 conversion" 90 "$DEST/smollm2_convert.log" \
    "$PY" -m pagedserve.cli fetch-model "$GGUF" --out "$SMOLLM2"
  export PAGEDSERVE_GPU_SMOLLM2=$SMOLLM2
  part "SmolLM2 oracle on CUDA" 120 "$DEST/smollm2_tests.log" \
    "$PY" -m pytest -q -s -p no:cacheprovider tests/gpu -k smollm2
  part "bench decode SmolLM2" 120 "$DEST/decode_bench.log" \
    "$PY" -m pagedserve.bench.decode --device cuda --model "$SMOLLM2" --reps 3 \
    --out "$DEST/decode_bench.json"
  "$PY" scripts/gpu_roofline.py "$SMOLLM2" "$DEST/decode_bench.json" >"$DEST/roofline.md" 2>&1
  cat "$DEST/roofline.md" | tee -a "$LOG"
else
  say "no SmolLM2 GGUF on this machine: its oracle and bench decode not run"
  RESULTS+=("| SmolLM2 | not run | | no GGUF on the machine |")
fi

# --- 5. paged attention micro-benchmark ------------------------------------------------------
part "bench kernels (bf16)" 90 "$DEST/kernel_bench.log" \
  "$PY" -m pagedserve.bench.kernels --device cuda --reps 5 --dtype bfloat16 \
  --out "$DEST/kernel_bench.md"

{
  echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  echo "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)."
  grep -m1 "^torch " "$LOG"
  echo
  echo "| part | result | time | last line |"
  echo "|---|---|---|---|"
  printf '%s\n' "${RESULTS[@]}"
  echo
  [ -f "$DEST/roofline.md" ] && cat "$DEST/roofline.md"
  echo
  [ -f "$DEST/kernel_bench.md" ] && cat "$DEST/kernel_bench.md"
} >"$REPORT"
cat "$REPORT"
say "done in $(($(date +%s) - START))s; report $REPORT"
