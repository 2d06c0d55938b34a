#!/usr/bin/env bash
# Issue 67's device run: expert-parallel serving on 2 GPUs (NCCL) against one GPU, on the 8-layer
# Qwen1.5-MoE-shaped model of recipes/perf_serving_gpu.sh (its `prep` makes the pack).
#   (s) scaling: the same per-GPU budget (15% over the calculator's for 16 x 2304 tokens) and the
#       same per-GPU load (16 concurrent 2048/256 a GPU): 1 rank (decode graphs on: the best one
#       GPU does) against `--expert-parallel 2` (steps eager: the exchange's splits are read on
#       the host), uniform:4 and pagedweight --max-bits 4; scaling = 2 ranks' out tok/s / 1's
#   (r) the pressure setting run per rank: each rank's budget = 16-bit weights + the KV of 4 x
#       2304 tokens, 32 concurrent 2048/256 a rank (no fp16 row: the 16-bit experts take no
#       exchange)
# Every row is `pwctl bench --throughput`; a 2-rank row's JSON has each rank's figures under
# `ranks` (exchange calls, bytes and seconds: all-to-all time a step = seconds / steps), merged
# into $OUT/serving.json.
# NVLink multicast stays off (the device tool's KINDS.md): NCCL_NVLS_ENABLE=0 and the rest are
# exported here again, so every rank a command starts inherits them.
# Usage (device tool, kind nvidia-h100-x2 or nvidia-h200-x2; carry .carry/cupy_cache.tgz):
#   bash recipes/perf_expert_parallel_gpu.sh all      (prep + s + r, one call of <= 570 s)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
PACK=${PACK:-/tmp/qwen-moe-pack}
JSON=${JSON:-/tmp/ep-json}
IO=(--input-len 2048 --output-len 256)
HERE=$(dirname "$0")
mkdir -p "$OUT" "$JSON"

source "$HERE/cupy_cache.sh"
source "$HERE/serving_steps.sh"  # budget, row, tp

case "${1:-}" in
s)
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  PLANES4=$(budget --what planes --planes uniform:4)
  MEM_S=$(budget --planes uniform:4 --seqs 16 --tokens 2304 --max-seqs 16 --measure)
  MEM_S=$((${MEM_S%b} * 115 / 100))b
  echo "(s) memory budget a GPU $MEM_S, BUDGET $PLANES4"
  for P in uniform:4 "pagedweight:$PLANES4"; do
    name=$(row "$P")
    tp "s1_$name" --concurrency 16 --requests 32 --max-seqs 16 --memory-budget "$MEM_S" \
      --policy "$P" --max-bits 4
    tp "s2_$name" --expert-parallel 2 --concurrency 32 --requests 64 --max-seqs 16 \
      --memory-budget "$MEM_S" --policy "$P" --max-bits 4
  done
  ;;
r)
  PLANES4=$(budget --what planes --planes uniform:4)
  MEM_B=$(budget --planes fp16 --seqs 4 --tokens 2304 --max-seqs 32 --measure)
  echo "(r) memory budget a rank $MEM_B, BUDGET $PLANES4"
  for P in uniform:4 "pagedweight:$PLANES4"; do
    tp "r2_$(row "$P")" --expert-parallel 2 --concurrency 64 --requests 128 --max-seqs 32 \
      --memory-budget "$MEM_B" --policy "$P"
  done
  ;;
report)  # one line a row (perf_serving_gpu.sh merge), each 2-rank row's ranks, the scaling
  JSON=$JSON OUT=$OUT bash "$HERE/perf_serving_gpu.sh" merge
  python3 - "$OUT/serving.json" <<'PY'
import json, sys
merged = json.load(open(sys.argv[1]))
for name, doc in merged.items():
    for r in doc.get("results", []):
        for rank in r.get("ranks") or []:
            ex, steps = rank["exchange"], max(rank["steps"], 1)
            print(f"{name:16s} rank {rank['rank']}: out {rank['output_tok_s']:.1f} tok/s, "
                  f"all-to-all {ex['seconds'] / steps * 1e3:.2f} ms a step, "
                  f"{ex['sent_bytes'] / 1e6:.1f} MB sent")
for pol in ("uniform4", "pagedweight"):
    one, two = merged.get(f"s1_{pol}"), merged.get(f"s2_{pol}")
    if one and two:
        a, b = one["results"][0]["output_tok_s"], two["results"][0]["output_tok_s"]
        print(f"scaling {pol}: {b / a:.2f}x on 2 GPUs ({b:.1f} against {a:.1f} tok/s)")
PY
  ;;
all)
  timeout "${CALL_S:-570}" bash -c "bash '$HERE/perf_serving_gpu.sh' prep &&
    for S in s r; do start=\$(date +%s); bash '$0' \$S;
    echo \"== stage \$S: \$((\$(date +%s) - start)) s\"; done"
  bash "$0" report
  save_cupy_cache
  ;;
*)
  echo "usage: $0 s|r|report|all" >&2
  exit 2
  ;;
esac
