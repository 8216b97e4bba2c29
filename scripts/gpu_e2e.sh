#!/usr/bin/env bash
# `sparsp bench e2e` on the lent 2xH200 machine, one model and fabric per run, results packed
# into $OUT/e2e.tgz. Diffusers travels as wheels in .whl/ (carry it; README "GPU checks"), FA4
# from an earlier scripts/gpu_session.sh call on the same warm machine ($SITE).
#
#   MODELS="ltx-video ltx-2" FABRICS="nvlink host" bash scripts/gpu_e2e.sh
#
# Knobs: MODELS, FABRICS, STEPS (timed steps, default 3), LAYERS (default 2), E2E_ARGS (extra
# bench e2e args), E2E_LIMIT (seconds per run, default 150), FRESH=1 deletes today's e2e files
# of MODELS first (a re-run then holds only its own rows).
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/fa4site}
OUT=${OUT:-/tmp/sparsp-out}
mkdir -p "$OUT/logs"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ! python3 -c 'import diffusers' 2>/dev/null && [[ ! -d /tmp/site/diffusers ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "no diffusers wheels in .whl/"; exit 1; }
fi
export PYTHONPATH="$PWD/src:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:/tmp/site"
today=$(date +%F)
for model in ${MODELS:-ltx-video}; do
  [[ "${FRESH:-0}" == 1 ]] && rm -f bench/results/e2e-"$model"-*-"$today".*
  for fabric in ${FABRICS:-nvlink host}; do
    log="$OUT/logs/e2e_${model}_${fabric}.log"
    timeout "${E2E_LIMIT:-150}" torchrun --standalone --nproc-per-node "${NPROC:-2}" -m sparsp.cli bench e2e \
      --model "$model" --fabric "$fabric" --steps "${STEPS:-3}" --warmup 1 --layers "${LAYERS:-2}" \
      --weights synthetic-structure ${E2E_ARGS:-} > "$log" 2>&1
    echo "== e2e $model $fabric rc=$?"; grep -E '^(1gpu|diffusers|ring|sparsp|ulysses|auto)|Error' "$log" | cut -c1-160 | head -n 12
  done
done
# (E2E_ARGS="--no-cuda-graphs --out bench/results/eager" keeps an eager run apart; it is packed too)
tar -czf "$OUT/e2e.tgz" $(ls bench/results/e2e-*-"$today".* bench/results/*/e2e-*-"$today".* 2>/dev/null) -C "$OUT" logs
