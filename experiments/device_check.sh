#!/usr/bin/env bash
# Pallas GPU kernels on an NVIDIA GPU: correctness, then speed.
#
#   PART=core bash experiments/device_check.sh   # tests + headline figures (about 6 minutes)
#   PART=more TUNE=1 bash experiments/device_check.sh  # the rest + tile sweeps (about 8 minutes)
#   bash experiments/device_check.sh             # PART=all: both (over one 600 s call with TUNE)
#   PART=decode bash experiments/device_check.sh # only the decode steps (PART=flash: only flash)
#   PART=moe bash experiments/device_check.sh    # only the MoE grouped-matmul kernels (not in all)
#
# Needs nothing installed from this repository: it runs the checkout with PYTHONPATH set to it,
# on the machine's own python3 with jax (CUDA), flax, jaxtyping, matplotlib, tqdm, pytest and
# pytest-xdist.
# Steps, each with its own time limit so one hang cannot eat the budget, most important first:
#   1. preflight: versions, the GPU as JAX sees it, missing packages named;
#   2. (core) the GPU kernel tests compiled, in one pytest run over 8 processes:
#      tests/kernels/test_decode_gpu.py, test_flash_gpu.py, test_flash_hopper.py and the cuDNN
#      backend of the dispatcher against the formula (tests/ops/test_attention_cudnn.py); then the
#      Triton kernels with a dense bias and mask array (tests/kernels/test_flash_dense.py -k gpu);
#   3. (core) the contiguous-cache decode tests on the GPU kernels, experiments.bench_decode
#      --check (kernels vs formulas at 32k context) and the decode benchmark (contiguous XLA,
#      paged XLA and the paged Pallas kernels against the copy bandwidth, 4k and 32k, batch
#      1..32);
#   4. (core) bench_flash --check and the forward benchmark against cuDNN and the bf16 matmul
#      peak (T = 2k..16k, causal and not) for the Hopper (Mosaic GPU) kernels, the Hopper
#      forward's schedules at T = 8k (bench_flash --sweep, the first eight HOPPER_SWEEP
#      settings: plain, overlap, overlap + ping-pong, the last two at 240 registers too, overlap
#      with 192-key steps, with 3 stages and with persistent CTAs), then
#      the Triton kernels; the Hopper forward + backward benchmark (T = 2k, 8k);
#   5. (more) the Triton forward + backward benchmark, and with a learned dense bias, a
#      key-padding mask array and a Flax mask [B, 1, T, T] (the Hopper kernels' tiles) on both
#      sides, and attention sinks + a causal window (block lists against cuDNN's boolean mask)
#      (bench_flash --dense; the bias' forward alone; on
#      Triton's backward its gradient by its own kernel, then by atomic adds: --shared-bias
#      atomic); the Hopper forward + backward
#      schedules
#      at T = 8k, causal (HOPPER_BWD_SWEEP: the backward's matmuls in turn or in flight
#      together, with each forward schedule; the dQ kernel at 64 or 128 keys per step); the
#      Hopper and Triton forwards at MLA's
#      prefill head sizes (192 / 128, T = 8k, against cuDNN where it takes them; forward +
#      backward too, the Hopper kernels against Triton's); the paged
#      decode kernels over int8 / fp8
#      caches (32k, batch 8 and 32); the top-K sparse (DSA) kernels compiled against the gather
#      reference and timed (experiments.bench_sparse_kernel), forward and forward + backward;
#   6. (more, TUNE=1) a few MLA decode tile settings at 32k; the flash tile and code-generation
#      sweep at T = 8k (Triton and Hopper tiles, against cuDNN and JAX's own Mosaic GPU flash
#      attention);
#   7. (PART=moe only) the grouped-matmul kernels: tests/kernels/test_grouped_matmul_gpu.py
#      compiled, then experiments.bench_moe at gpt-oss-20b's expert sizes (32 of 2880 x 2880,
#      top-4, 4096 tokens, bf16), every expert densely vs XLA's blocked loop and ragged_dot vs the
#      Pallas kernels, forward and forward + backward, and with the experts in MXFP4.
# Everything printed goes to $OUT/device_check.log (or runs/), with the plots beside it.
# The whole run keeps within BUDGET_S seconds (default 560, under a 600 s limit on the call): each
# step's limit is cut to the time left, a step is skipped (SKIPPED <name>: <n> s left) when fewer
# than MIN_STEP_S (30) remain, and the closing "device_check: PASSED" / "device_check: FAILED ..."
# line is always printed (a skipped step counts as failed).
# Exit status: 0 when every step passed.
set -uo pipefail
DEADLINE=$((SECONDS + ${BUDGET_S:-560}))
MIN_STEP_S="${MIN_STEP_S:-30}"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Let XLA take GPU memory as needed rather than 75% up front (the benchmarks compile several
# programs side by side).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"
DEST="${OUT:-runs}"
mkdir -p "$DEST"
WORK="$(mktemp -d)"
exec > >(tee "$DEST/device_check.log") 2>&1
TEE_PID=$!
status=0
SKIPPED=()

finish() {  # finish [NOTE [WAIT_S]]: the summary line, the log flushed (tee drained), exit
  local note="${1:-}"
  local name
  for name in ${SKIPPED[@]+"${SKIPPED[@]}"}; do
    note="${note:+$note; }skipped: $name"
  done
  if [ "$status" -eq 0 ]; then
    echo "device_check: PASSED"
  else
    echo "device_check: FAILED${note:+ ($note)}"
  fi
  trap - EXIT
  rm -rf "$WORK"
  # Close our end of the log pipe so tee reads end of input, and let it write the last lines
  # before we exit (waiting at most ${2:-10} s, should a stray process still hold the pipe open).
  exec >&- 2>&-
  local i
  for i in $(seq $((${2:-10} * 10))); do kill -0 "$TEE_PID" 2>/dev/null || break; sleep 0.1; done
  exit "$status"
}
# An unexpected exit (an error, a signal) still prints the summary and flushes the log.
trap 'status=1; finish "interrupted" 2' EXIT

step() {  # step NAME SECONDS CMD...   (runs in this shell, so `status` sticks)
  local name="$1" limit="$2"
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    echo "=== SKIPPED $name: $left s left"
    SKIPPED+=("$name")
    status=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" 2>&1
  local rc=$?
  local why=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (time limit)"
  echo "=== $name: exit $rc$why after $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || status=1
}

step preflight 60 "$PY" - <<'PYEOF'
import importlib.util, sys
missing = [m for m in ("jax", "flax", "jaxtyping", "numpy", "pytest", "xdist", "tqdm",
                     "matplotlib")
           if importlib.util.find_spec(m) is None]
if missing:
  sys.exit(f"missing Python packages: {missing} (carry them as wheels)")
import flax, jax
print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__,
      "devices", jax.devices())
if jax.default_backend() not in ("gpu", "cuda"):
  sys.exit(f"JAX sees no GPU (backend {jax.default_backend()!r})")
PYEOF
if [ "$status" -ne 0 ]; then
  echo "preflight failed; nothing else run"
  finish "preflight"
fi

PART="${PART:-all}"
if [ "$PART" = moe ]; then
step "grouped matmul kernel tests" 120 \
  "$PY" -m pytest -q -rf --maxfail=3 -p no:cacheprovider tests/kernels/test_grouped_matmul_gpu.py
MOE=(--tokens 4096 --experts 32 --top-k 4 --embed 2880 --expert-dim 2880 --dtype bfloat16
     --paths dense,blocked,ragged_dot,pallas_gpu --reps 5)
step "MoE benchmark (gpt-oss experts, bf16)" 120 \
  "$PY" -m experiments.bench_moe "${MOE[@]}" --out "$WORK/moe"
step "MoE benchmark, forward + backward" 120 \
  "$PY" -m experiments.bench_moe "${MOE[@]}" --backward --out "$WORK/moe_bwd"
step "MoE benchmark, MXFP4 experts" 120 \
  "$PY" -m experiments.bench_moe "${MOE[@]}" --mxfp4 --out "$WORK/moe_mxfp4"
for d in moe moe_bwd moe_mxfp4; do
  cp "$WORK/$d/results.json" "$DEST/${d}_results.json" 2>/dev/null
done
finish
fi
# PART=core: every GPU kernel test in one pytest run (parallel processes: compiling is CPU-bound),
# then the headline figures (decode kernels vs the copy bandwidth; the Hopper and Triton flash
# kernels vs cuDNN and the matmul peak). PART=more: the rest (quantized decode caches, sparse
# kernels, backward benchmarks at more lengths) and, with TUNE=1, the tile sweeps. PART=all: both.
# PART=decode / PART=flash: one family's steps only (tests, figures, its TUNE sweep).
want() {  # want GROUP FAMILY: does this run include the step?
  case "$PART" in
    all) return 0 ;;
    core|more) [ "$PART" = "$1" ] ;;
    decode|flash) [ "$PART" = "$2" ] ;;
    *) return 1 ;;
  esac
}
case "$PART" in all|core|more|decode|flash) ;; *)
  echo "unknown PART=$PART (all, core, more, decode, flash, moe)"; status=1; finish "PART" ;;
esac
TESTS=()
want core decode && TESTS+=(tests/kernels/test_decode_gpu.py)
want core flash && TESTS+=(tests/kernels/test_flash_gpu.py tests/kernels/test_flash_hopper.py
                           tests/ops/test_attention_cudnn.py)
if [ ${#TESTS[@]} -gt 0 ]; then
  step "GPU kernel tests (${TESTS[*]})" 170 \
    "$PY" -m pytest -q -rf -n 8 -p no:cacheprovider -m "slow or not slow" "${TESTS[@]}"
fi
if want core flash; then  # the Triton kernels with a dense bias / mask array (the GPU cases)
  step "GPU kernels with a dense bias and mask array" 90 \
    "$PY" -m pytest -q -rf -n 8 -p no:cacheprovider tests/kernels/test_flash_dense.py -k gpu
fi
if want core decode; then
  # the contiguous caches read as pages by the same kernels (what automatic dispatch now takes on
  # NVIDIA GPUs for a module's KVCache / LatentCache)
  step "contiguous-cache decode on the GPU kernels" 60 \
    "$PY" -m pytest -q -rf -p no:cacheprovider tests/kernels/test_cache_decode.py -k pallas_gpu
  step "decode check + benchmark" 150 \
    "$PY" -m experiments.bench_decode --check --kind gqa,mla --contexts 4096,32768 \
    --batches 1,8,32 --impls contiguous,xla_paged,pallas_gpu_paged --repeats 5 --out "$WORK/decode"
  cp "$WORK/decode/bench_decode.png" "$WORK/decode/results.json" "$DEST/" 2>/dev/null
fi
if want core flash; then
  step "hopper kernels: check + forward benchmark" 100 \
    "$PY" -m experiments.bench_flash --gpu-forward hopper --gpu-backward hopper --check \
    --seq-lens 2048 4096 8192 16384 --repeats 5 --plot "$DEST/bench_flash_gpu_hopper.png"
  if want core -; then  # tuning (PART=core / all): PART=flash stays the issue's short run
    step "hopper forward schedules at 8k (plain, overlap, ping-pong, 192 keys, persistent)" 200 \
      "$PY" -m experiments.bench_flash --sweep 8192 --sweep-kernels hopper --hopper-first 8 \
      --repeats 5
  fi
  step "triton kernels: check + forward benchmark" 100 \
    "$PY" -m experiments.bench_flash --gpu-forward triton --gpu-backward triton --check \
    --seq-lens 2048 4096 8192 16384 --repeats 5 --plot "$DEST/bench_flash_gpu.png"
  step "hopper kernels: forward+backward benchmark" 60 \
    "$PY" -m experiments.bench_flash --gpu-forward hopper --gpu-backward hopper --backward \
    --seq-lens 2048 8192 --repeats 3 --plot "$DEST/bench_flash_gpu_hopper_bwd.png"
fi
if want more flash; then
  step "triton kernels: forward+backward benchmark" 60 \
    "$PY" -m experiments.bench_flash --gpu-forward triton --gpu-backward triton --backward \
    --seq-lens 2048 8192 --repeats 3 --plot "$DEST/bench_flash_gpu_bwd.png"
  # both sides given the same dense input (cuDNN takes them; sinks: cuDNN the boolean array,
  # ours the position mask, whose block lists skip the blocks between the sinks and the window)
  for d in bias mask flax-mask sinks; do
    step "dense $d: forward + backward against cuDNN" 60 \
      "$PY" -m experiments.bench_flash --dense "$d" --backward --seq-lens 2048 8192 \
      --repeats 3 --no-plot
  done
  # the forward alone with the bias (the Hopper forward streams its tiles; Triton's otherwise)
  step "dense bias: forward against cuDNN" 45 \
    "$PY" -m experiments.bench_flash --dense bias --seq-lens 2048 8192 --repeats 3 --no-plot
  # Triton's backward with the batch-shared bias' gradient both ways (its own kernel, atomic
  # adds in the dQ kernel): which default the Triton option `shared_bias` should have
  for way in kernel atomic; do
    step "dense bias, Triton backward, gradient by $way: forward + backward against cuDNN" 60 \
      "$PY" -m experiments.bench_flash --dense bias --gpu-backward triton --shared-bias "$way" \
      --backward --seq-lens 2048 8192 --repeats 3 --no-plot
  done
  if want more -; then  # tuning (PART=more / all)
    step "hopper forward + backward schedules at 8k (causal; backward overlap, dQ steps)" 190 \
      "$PY" -m experiments.bench_flash --sweep 8192 --sweep-kernels hopper --backward \
      --backward-only --repeats 3
  fi
  step "hopper forward at MLA's prefill head sizes (192 / 128)" 80 \
    "$PY" -m experiments.bench_flash --head-dim 192 --v-head-dim 128 --sweep 8192 \
    --sweep-kernels hopper --hopper-first 3 --repeats 3
  step "triton forward at MLA's prefill head sizes (192 / 128)" 40 \
    "$PY" -m experiments.bench_flash --head-dim 192 --v-head-dim 128 --gpu-forward triton \
    --seq-lens 8192 --repeats 3 --no-plot
  for k in hopper triton; do  # the Hopper backward's separate dK and dV kernels vs Triton's 256
    step "$k forward + backward at MLA's prefill head sizes (192 / 128)" 60 \
      "$PY" -m experiments.bench_flash --head-dim 192 --v-head-dim 128 --gpu-forward "$k" \
      --gpu-backward "$k" --backward --seq-lens 8192 --repeats 3 --no-plot
  done
fi
if want more decode; then
  step "decode over quantized caches (int8, fp8)" 120 \
    "$PY" -m experiments.bench_decode --kind gqa,mla --contexts 32768 --batches 8,32 \
    --impls contiguous,pallas_gpu_paged --kv-quant none,int8,fp8 --repeats 5 \
    --out "$WORK/decode_quant"
  cp "$WORK/decode_quant/results.json" "$DEST/decode_quant.json" 2>/dev/null
  step "sparse (DSA) kernels: check + benchmark" 150 \
    "$PY" -m experiments.bench_sparse_kernel --check --contexts 8192,32768 --repeats 5 \
    --out "$WORK/sparse"
  cp "$WORK/sparse/results.json" "$DEST/sparse_results.json" 2>/dev/null
  step "sparse (DSA) kernels: forward + backward" 120 \
    "$PY" -m experiments.bench_sparse_kernel --check --backward --contexts 8192 --repeats 3 \
    --out "$WORK/sparse_bwd"
fi
if [ "${TUNE:-0}" = 1 ] && want more decode; then
  for cfg in "64 8 2" "64 4 3" "32 4 3" "16 4 2"; do
    set -- $cfg
    step "MLA decode tiles: block_k=$1 warps=$2 stages=$3" 40 \
      "$PY" -m experiments.bench_decode --kind mla --contexts 32768 --batches 8,32 \
      --impls pallas_gpu_paged --gpu-block-k "$1" --gpu-warps "$2" --gpu-stages "$3" \
      --repeats 5 --out "$WORK/tiles"
  done
fi
if [ "${TUNE:-0}" = 1 ] && want more flash; then
  step "flash tile sweep (forward; forward + backward, causal)" 200 \
    "$PY" -m experiments.bench_flash --sweep 8192 --backward --sweep-switches --repeats 5
fi
finish
