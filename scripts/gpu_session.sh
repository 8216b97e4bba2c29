#!/usr/bin/env bash
# One device call that does a whole step on the lent 2xH200 machine: install FA4 from the
# wheelhouse (../shared/tools/fa4-wheelhouse.sh; part1 staged at $STAGE by an earlier call),
# then the kernel GPU tests, `bench kernel`, and `bench attention` on both fabrics for the
# presets named in $PRESETS. Results are packed into $OUT/results.tgz (one file comes back).
#
#   STAGE=/tmp/fa4stage PRESETS="ltx-video hunyuan-video" bash scripts/gpu_session.sh
#
# Other knobs: RUN (a folder name: the attention rows go to $OUT/$RUN instead of bench/results,
# each fabric at its committed link figure — bench/results/transport-all-2xH200-2026-11-30.json:
# NVLink 381.72, host 39.44 GB/s — and a short summary of each run is printed),
# TESTS (pytest paths and args of gpu-marked tests; empty skips them; when they
# fail the benchmarks are skipped), TEST_LIMIT (seconds),
# KERNEL_SHAPES (bench kernel --shape), FABRICS, ATTN_ARGS (extra bench attention args),
# ATTN_LIMIT (seconds per attention run), NPROC (GPUs per attention run, default 2),
# LATE_TESTS (gpu-marked tests run after the benchmarks, not gating them).
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
if [[ -n "${TESTS:-}" ]]; then  # pytest paths / args; the benchmarks run only when they pass
  LIMIT=${TEST_LIMIT:-200} run gpu_tests python3 -m pytest -o addopts="" -m gpu -q -x $TESTS
  grep -qE "[0-9]+ passed" "$OUT/logs/gpu_tests.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/logs/gpu_tests.log" \
    || { echo "gpu tests did not pass: benchmarks skipped"; PRESETS=""; KERNEL_SHAPES=""; }
fi
[[ -n "${KERNEL_SHAPES:-}" ]] && LIMIT=${KERNEL_LIMIT:-200} run bench_kernel python3 -m sparsp.cli bench kernel --shape $KERNEL_SHAPES
declare -A LINK=([nvlink]=381.72 [host]=39.44)
for preset in ${PRESETS:-}; do
  for fabric in ${FABRICS:-nvlink host}; do
    where=()
    [[ -n "${RUN:-}" ]] && { mkdir -p "$OUT/$RUN"; where=(--out "$OUT/$RUN" --link-gbps "${LINK[$fabric]}"); }
    LIMIT=${ATTN_LIMIT:-200} run "attn_${preset}_${fabric}" torchrun --standalone --nproc-per-node "${NPROC:-2}" -m sparsp.cli \
      bench attention --model "$preset" --fabric "$fabric" "${where[@]}" ${ATTN_ARGS:-}
    [[ -n "${RUN:-}" ]] && grep -E "cdf [0-9.]+: " "$OUT/logs/attn_${preset}_${fabric}.log" | cut -c1-110
  done
done
[[ -n "${LATE_TESTS:-}" ]] && LIMIT=${TEST_LIMIT:-200} run late_gpu_tests python3 -m pytest -o addopts="" -m gpu -q $LATE_TESTS
# ATTN_ARGS="... --profile $OUT/prof" leaves op tables and traces there; they travel in the archive
if [[ -n "${RUN:-}" ]]; then  # the run folder holds this call's rows: bench/results is untouched
  tar -czf "$OUT/results.tgz" -C "$OUT" logs "$RUN" $([[ -d "$OUT/prof" ]] && echo prof) 2>/dev/null
else
  tar -czf "$OUT/results.tgz" bench/results/*-2026-*.json bench/results/*-2026-*.png -C "$OUT" logs \
    $([[ -d "$OUT/prof" ]] && echo prof) 2>/dev/null
fi
ls -la "$OUT"
