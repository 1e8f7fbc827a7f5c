#!/usr/bin/env bash
# Flash-attention kernels on an NVIDIA GPU: correctness, then speed, in under 5 minutes.
#
#   bash experiments/device_check.sh            # from the repository root or anywhere
#
# Needs nothing installed from this repository: it runs the checkout with PYTHONPATH set to it,
# on the machine's own python3 with jax (CUDA), flax, jaxtyping and pytest.  Steps, each with its
# own time limit so one hang cannot eat the budget:
#   1. preflight: versions, the GPU as JAX sees it, missing packages named;
#   2. tests/kernels/test_flash_gpu.py on the compiled kernels (forward, gradients, bf16, masks);
#   3. experiments.bench_flash --check: kernel vs formula at realistic sizes on the device, then
#      the forward benchmark against cuDNN and the bf16 matmul peak, T = 2k..16k, causal and not;
#   4. the kernels' block sizes swept at T = 8k (TFLOP/s per tile, against cuDNN and JAX's own
#      Mosaic GPU flash attention);
#   5. the forward + backward benchmark at T = 2k and 8k;
#   6. the decode benchmark (contiguous vs paged XLA paths against the copy bandwidth).
# Outputs (log, table, plot) go to $OUT if set, else runs/.  Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Let XLA take GPU memory as needed rather than 75% up front (the benchmark compiles several
# programs side by side).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"
DEST="${OUT:-runs}"
mkdir -p "$DEST"
status=0

step() {  # step NAME SECONDS LOGFILE CMD...   (runs in this shell, so `status` sticks)
  local name="$1" limit="$2" log="$3"
  shift 3
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || status=1
}

step preflight 60 "$DEST/preflight.log" "$PY" - <<'PYEOF'
import importlib.util, sys
missing = [m for m in ("jax", "flax", "jaxtyping", "numpy", "pytest")
           if importlib.util.find_spec(m) is None]
if missing:
  sys.exit(f"missing Python packages: {missing} (carry them as wheels)")
import jax
print("python", sys.version.split()[0], "jax", jax.__version__, "devices", jax.devices())
import flax
print("flax", flax.__version__)
if jax.default_backend() not in ("gpu", "cuda"):
  sys.exit(f"JAX sees no GPU (backend {jax.default_backend()!r})")
PYEOF
if [ "$status" -ne 0 ]; then
  echo "preflight failed; nothing else run"
  exit 1
fi

step "kernel tests" 120 "$DEST/test_flash_gpu.log" \
  "$PY" -m pytest -q -rf --maxfail=3 -p no:cacheprovider tests/kernels/test_flash_gpu.py
step "check + forward benchmark" 120 "$DEST/bench_flash_gpu.txt" \
  "$PY" -m experiments.bench_flash --check --seq-lens 2048 4096 8192 16384 --repeats 5 \
  --plot "$DEST/bench_flash_gpu.png"
step "block-size sweep (forward; forward + backward, causal)" 150 "$DEST/sweep_flash_gpu.txt" \
  "$PY" -m experiments.bench_flash --sweep 8192 --backward --repeats 5
step "forward+backward benchmark" 60 "$DEST/bench_flash_gpu_bwd.txt" \
  "$PY" -m experiments.bench_flash --backward --seq-lens 2048 8192 --repeats 3 \
  --plot "$DEST/bench_flash_gpu_bwd.png"
step "decode benchmark (XLA contiguous vs paged, vs copy bandwidth)" 90 "$DEST/bench_decode.txt" \
  "$PY" -m experiments.bench_decode --contexts 4096,32768 --batches 1,8 \
  --impls contiguous,xla_paged --repeats 3 --out "$DEST/bench_decode"
echo "device_check: $([ "$status" -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
