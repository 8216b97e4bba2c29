#!/usr/bin/env bash
# GPU check: the `gpu`-marked tests and a GPU soak, then the benchmarks on both fabrics, then
# a short table last. Run it on a machine with CUDA GPUs (`make gpu-test` runs `tests`).
#
#   scripts/gpu_check.sh [tests|soak|bench|attention|transport|all]   (default: all)
#
# Runs from a plain checkout with the machine's own python3 (or $PYTHON) and its own torch, no
# installs: the package is used from src/ via PYTHONPATH. Results land in bench/results/ and,
# when $OUT is set, are copied there too. Knobs: PRESETS, CDFS, ATTN_ARGS, TRANSPORT_ARGS,
# SOAK_CALLS.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
MODE=${1:-all}
OUT_DIR=${OUT:-/tmp/sparsp-gpu-check}
mkdir -p "$OUT_DIR" bench/results
NPROC=$($PY -c 'import torch; print(torch.cuda.device_count())')
status=0

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
$PY -c 'from cuda.bindings import driver; print("cuda-bindings ok")' 2>/dev/null || echo "cuda-bindings: not importable"

if [[ $MODE == tests || $MODE == all ]]; then
  echo "== gpu tests"
  $PY -m pytest -o addopts="" -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT_DIR/gpu_tests.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi

if [[ $MODE == soak || $MODE == tests || $MODE == all ]]; then
  echo "== gpu soak (2,000 sp_attention calls, device memory before/after)"
  $PY scripts/gpu_soak.py --calls "${SOAK_CALLS:-2000}" --world "$NPROC" 2>&1 | tee "$OUT_DIR/gpu_soak.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi

run_torchrun() {  # torchrun with one process per GPU
  torchrun --standalone --nproc-per-node "$NPROC" -m sparsp.cli "$@"
}

if [[ $MODE == attention || $MODE == bench || $MODE == all ]]; then
  # the four presets at three thresholds, every strategy and the one-GPU rows, on each fabric
  # (about 200 s per fabric for the four presets at one threshold on 2×H200)
  for fabric in nvlink host; do
    p2p=""; [[ $fabric == host ]] && p2p=1
    for preset in ${PRESETS:-hunyuan-video wan2.1-14b ltx-video ltx-2}; do
      echo "== attention benchmark, $preset, fabric $fabric"
      NCCL_P2P_DISABLE=${p2p:-${NCCL_P2P_DISABLE:-0}} run_torchrun bench attention --model "$preset" --fabric "$fabric" \
        --cdf ${CDFS:-0.85 0.9 0.95} ${ATTN_ARGS:-} 2>&1 | tee "$OUT_DIR/attention_${preset}_$fabric.log" || status=1
    done
  done
fi

if [[ $MODE == transport || $MODE == bench || $MODE == all ]]; then
  if $PY -c 'import sparsp.bench.transport' 2>/dev/null; then
    for fabric in nvlink host; do
      echo "== transport benchmark, fabric $fabric"
      run_torchrun bench transport --fabric "$fabric" ${TRANSPORT_ARGS:-} 2>&1 \
        | tee "$OUT_DIR/transport_$fabric.log" || status=1
    done
  fi
fi

today=$(date +%F)
cp bench/results/*-"$today".json bench/results/*-"$today".png "$OUT_DIR"/ 2>/dev/null || true
echo "== summary"
ls bench/results/*-"$today".json >/dev/null 2>&1 && { $PY -m sparsp.cli bench report bench/results/*-"$today".json || status=1; }
[[ -f "$OUT_DIR/gpu_tests.log" ]] && { echo "gpu tests: $(tail -n 1 "$OUT_DIR/gpu_tests.log")"; }
[[ -f "$OUT_DIR/gpu_soak.log" ]] && { echo "gpu soak: $(tail -n 1 "$OUT_DIR/gpu_soak.log")"; }
exit $status
