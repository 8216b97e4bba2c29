#!/usr/bin/env bash
# One device call of attention benchmarks into a run folder, both fabrics, each fabric at its
# committed link figure (bench/results/transport-all-2xH200-2026-11-30.json: NVLink 381.72,
# host 39.44 GB/s), so the rows are comparable with the day's earlier ones without touching
# bench/results/. Results and logs are packed into $OUT/results.tgz.
#
#   STAGE=/tmp/fa4stage PRESETS="ltx-video ltx-2" RUN=runs/x TESTS="tests/test_strategies_gpu.py" \
#     bash scripts/gpu_attn_round.sh
#
# Knobs: PRESETS, FABRICS (default "nvlink host"), CDFS (default 0.9), ATTN_ARGS (extra args),
# ATTN_LIMIT (seconds per run), TESTS (gpu-marked tests first; benchmarks skipped when they fail).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-/tmp/fa4stage}
SITE=${SITE:-/tmp/fa4site}
OUT=${OUT:-/tmp/sparsp-out}
RUN_DIR="$OUT/${RUN:-run}"
mkdir -p "$RUN_DIR/logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [[ -f "$STAGE/runtime.part.aa" && -f .fa4/part2/install.sh && ! -d "$SITE/flash_attn" ]]; then
  bash .fa4/part2/install.sh "$STAGE" "$SITE" > "$RUN_DIR/logs/fa4_install.log" 2>&1 || echo "FA4 install failed"
fi
export PYTHONPATH="$PWD/src:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
python3 -c 'import flash_attn.cute; print("fa4 importable")' 2>&1 | tail -1
declare -A LINK=([nvlink]=381.72 [host]=39.44)
if [[ -n "${TESTS:-}" ]]; then
  timeout "${TEST_LIMIT:-240}" python3 -m pytest -o addopts="" -m gpu -q -x -p no:cacheprovider $TESTS > "$RUN_DIR/logs/gpu_tests.log" 2>&1
  echo "gpu tests: $(tail -n 1 "$RUN_DIR/logs/gpu_tests.log")"
  grep -qE "[0-9]+ passed" "$RUN_DIR/logs/gpu_tests.log" && ! grep -qE "[0-9]+ (failed|error)" "$RUN_DIR/logs/gpu_tests.log" \
    || { echo "gpu tests did not pass: benchmarks skipped"; tail -n 30 "$RUN_DIR/logs/gpu_tests.log"; PRESETS=""; }
fi
for preset in ${PRESETS:-}; do
  for fabric in ${FABRICS:-nvlink host}; do
    log="$RUN_DIR/logs/attn_${preset}_$fabric.log"
    timeout "${ATTN_LIMIT:-150}" torchrun --standalone --nproc-per-node 2 -m sparsp.cli bench attention \
      --model "$preset" --fabric "$fabric" --cdf ${CDFS:-0.9} --link-gbps "${LINK[$fabric]}" \
      --out "$RUN_DIR" ${ATTN_ARGS:-} > "$log" 2>&1
    echo "== $preset $fabric rc=$?"; grep -E "sparsp|ring-relay|auto|1gpu|Error|error" "$log" | grep -v Warning | cut -c1-170 | head -12
  done
done
tar -czf "$OUT/results.tgz" -C "$OUT" "${RUN:-run}"
