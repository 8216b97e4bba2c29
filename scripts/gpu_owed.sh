#!/usr/bin/env bash
# The measurements owed to the next session with the 2-GPU machine (docs/performance.md, "Owed to
# the next 2-GPU session"), one device call per step, so that each call's command stays short:
#
#   bash scripts/gpu_owed.sh stage      # carry .fa4/part1: FA4's first half to $STAGE (seconds)
#   bash scripts/gpu_owed.sh c12        # carry .fa4/part2, at once after `stage` (warm machine):
#                                       # GPU tests, Wan 2.1 host fabric (profiled), LTX-2 host 4-chunk drain
#   bash scripts/gpu_owed.sh c3456      # LTX-2 host: drain in 2, a 1 MiB first piece, local first, 2 H2D streams
#   bash scripts/gpu_owed.sh c7         # LTX sizes, both fabrics: the eleventh session's summing graph
#                                       # and kept buffers against both off, in the same rounds
#   bash scripts/gpu_owed.sh c8         # LTX sizes, both fabrics: sparsp and auto with 4 input sets
#                                       # cycled (new masks every call: auto's choice as in a real loop)
#   bash scripts/gpu_owed.sh copies     # the host fabric's copies: topology, NUMA placement, H2D streams
#   bash scripts/gpu_owed.sh official   # every strategy, all four presets, both fabrics, cdf 0.9
#                                       # -> bench/results/attention-*-2xH200-<date>.json (≈ 480 s)
#   bash scripts/gpu_owed.sh one        # ONE GPU (nvidia-h200), after `stage` + FA4 installed by
#                                       # gpu_session.sh: every gpu-marked test, then the drain
#                                       # units' stage and host cost (probe_stage_units.py, 2 ranks on
#                                       # the one GPU) at the four presets (≈ 330 s)
#
# Each step packs what it wrote into one archive under $OUT (at most 8 files come back). Steps
# that run attention rows need FA4 installed on the warm machine (`stage`, then `c12` first).
set -uo pipefail
cd "$(dirname "$0")/.."
step=${1:-}
OUT=${OUT:-/tmp/sparsp-out}
export STAGE=${STAGE:-/tmp/fa4stage} OUT NCCL_NVLS_ENABLE=0
S=scripts/gpu_session.sh
A="--cdf 0.9 --iters 10 --strategy sparsp"
G='^==|^rc=|cdf 0.9:|gpu tests|fa4'
case "$step" in
  stage)
    mkdir -p "$STAGE" && cp .fa4/part1/runtime.part.aa "$STAGE/" && ls -la "$STAGE" ;;
  c12)
    TESTS="tests/test_strategies_gpu.py tests/test_one_gpu_pair.py" TEST_LIMIT=240 RUN=c1 PRESETS=wan2.1-14b \
      FABRICS=host ATTN_LIMIT=150 ATTN_ARGS="$A --profile $OUT/prof/wan" bash $S | grep -E "$G"
    RUN=c2 PRESETS=ltx-2 FABRICS=host ATTN_LIMIT=100 ATTN_ARGS="$A --drain-chunks 4 --profile $OUT/prof/l4" \
      bash $S | grep -E "$G"
    rm -f "$OUT/results.tgz"; tar -czf "$OUT/c12.tgz" -C "$OUT" logs c1 c2 prof ;;
  c3456)
    RUN=c3 PRESETS=ltx-2 FABRICS=host ATTN_LIMIT=100 ATTN_ARGS="$A --drain-chunks 2" bash $S | grep -E "$G"
    SPARSP_FIRST_CHUNK_BYTES=1MiB RUN=c4 PRESETS=ltx-2 FABRICS=host ATTN_LIMIT=100 ATTN_ARGS="$A" bash $S | grep -E "$G"
    RUN=c5 PRESETS="ltx-video ltx-2" FABRICS=host ATTN_LIMIT=100 ATTN_ARGS="$A --local-first on" bash $S | grep -E "$G"
    SPARSP_H2D_STREAMS=2 RUN=c6 PRESETS=ltx-2 FABRICS=host ATTN_LIMIT=100 ATTN_ARGS="$A" bash $S | grep -E "$G"
    rm -f "$OUT/results.tgz"; tar -czf "$OUT/c3456.tgz" -C "$OUT" logs c3 c4 c5 c6 ;;
  c7)
    RUN=c7 PRESETS="ltx-video ltx-2" ATTN_LIMIT=120 \
      ATTN_ARGS="$A --iters 20 --env-variant SPARSP_SUMS_GRAPH=0,SPARSP_CALL_BUFFERS=0" bash $S | grep -E "$G"
    rm -f "$OUT/results.tgz"; tar -czf "$OUT/c7.tgz" -C "$OUT" logs c7 ;;
  c8)
    RUN=c8 PRESETS="ltx-video ltx-2" ATTN_LIMIT=150 \
      ATTN_ARGS="--cdf 0.9 --iters 20 --strategy sparsp auto --input-sets 4 --no-1gpu" bash $S | grep -E "$G"
    rm -f "$OUT/results.tgz"; tar -czf "$OUT/c8.tgz" -C "$OUT" logs c8 ;;
  copies)
    export PYTHONPATH="$PWD/src:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages"
    mkdir -p "$OUT/copies"
    nvidia-smi topo -m | head -4
    timeout 100 python3 scripts/probe_host_numa.py --iters 10 | tail -6
    timeout 60 python3 scripts/probe_copy_streams.py --streams 1 2 | tail -2
    NCCL_P2P_DISABLE=1 timeout 100 torchrun --standalone --nproc-per-node 2 scripts/probe_read_to_pack.py \
      --model ltx-2 --transport host --out "$OUT/copies/rtp.json" | tail -4
    for v in "1 off" "2 off" "1 writer" "1 reader"; do
      set -- $v
      SPARSP_HOST_NUMA=$2 timeout 90 torchrun --standalone --nproc-per-node 2 -m sparsp.cli bench transport \
        --fabric host --transports host --min-bytes 16MiB --max-bytes 256MiB --factor 16 --no-load \
        --h2d-streams "$1" --out "$OUT/copies/t$1$2" --no-plot 2>&1 | tail -4
    done
    tar -czf "$OUT/copies.tgz" -C "$OUT" copies ;;
  one)
    TESTS="tests" TEST_LIMIT=300 RUN=one PRESETS="" bash $S | grep -E "$G"
    export PYTHONPATH="$PWD/src:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages"
    mkdir -p "$OUT/one"
    timeout 240 torchrun --standalone --nproc-per-node 2 scripts/probe_stage_units.py \
      --models ltx-video ltx-2 wan2.1-14b hunyuan-video --out "$OUT/one/units.json" > "$OUT/logs/units.log" 2>&1
    echo "units rc=$?"; tail -n 20 "$OUT/logs/units.log"
    rm -f "$OUT/results.tgz"; tar -czf "$OUT/one.tgz" -C "$OUT" logs one ;;
  official)
    ATTN_ARGS="--cdf 0.9" ATTN_LIMIT=150 PRESETS="ltx-video ltx-2 wan2.1-14b hunyuan-video" bash $S | grep -E "$G" ;;
  *)
    sed -n "2,22p" "$0"; exit 2 ;;
esac
