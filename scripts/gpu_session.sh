#!/usr/bin/env bash
# One device call that does a whole step on the lent 2xH200 machine: install FA4 from the
# wheelhouse (../shared/tools/fa4-wheelhouse.sh; part1 staged at $STAGE by an earlier call),
# then the kernel GPU tests, `bench kernel`, and `bench attention` on both fabrics for the
# presets named in $PRESETS. Results are packed into $OUT/results.tgz (one file comes back).
#
#   STAGE=/tmp/fa4stage PRESETS="ltx-video hunyuan-video" bash scripts/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-/tmp/fa4stage}
SITE=${SITE:-/tmp/fa4site}
OUT=${OUT:-/tmp/sparsp-out}
mkdir -p "$OUT/logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [[ -f "$STAGE/runtime.part.aa" && -f .fa4/part2/install.sh && ! -d "$SITE/flash_attn" ]]; then
  bash .fa4/part2/install.sh "$STAGE" "$SITE" > "$OUT/logs/fa4_install.log" 2>&1 || echo "FA4 install failed"
fi
export PYTHONPATH="$PWD/src:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages"
python3 -c 'import flash_attn.cute; print("fa4 importable")' 2>&1 | tail -1
run() { local name=$1; shift; echo "== $name"; timeout "${LIMIT:-240}" "$@" > "$OUT/logs/$name.log" 2>&1; echo "rc=$? $(tail -n 2 "$OUT/logs/$name.log" | tr '\n' ' ' | cut -c1-300)"; }
[[ -n "${TESTS:-}" ]] && LIMIT=200 run kernel_tests python3 -m pytest -o addopts="" -m gpu -q -x tests/test_kernels_gpu.py $TESTS
[[ -n "${KERNEL_SHAPES:-}" ]] && LIMIT=200 run bench_kernel python3 -m sparsp.cli bench kernel --shape $KERNEL_SHAPES
for preset in ${PRESETS:-}; do
  for fabric in ${FABRICS:-nvlink host}; do
    LIMIT=${ATTN_LIMIT:-200} run "attn_${preset}_${fabric}" torchrun --standalone --nproc-per-node 2 -m sparsp.cli \
      bench attention --model "$preset" --fabric "$fabric" ${ATTN_ARGS:-}
  done
done
tar -czf "$OUT/results.tgz" bench/results/*-2026-*.json bench/results/*-2026-*.png -C "$OUT" logs 2>/dev/null
ls -la "$OUT"
