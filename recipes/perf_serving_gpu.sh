#!/usr/bin/env bash
# Device run for docs/PERF.md (issue 7's GPU settings) on a real-shape Qwen1.5-MoE-sized model
# (hidden 2048, 60 experts of width 1408, top-4; Mixtral naming, synthetic Student-t weights):
#   (a) no pressure: pagedweight vs uniform:4 at equal memory, input 2048, batch 1 and 4
#   (b) pressure: --memory-budget = fp16 weights + the KV of 4 sequences of 2304 tokens,
#       32 concurrent requests of 2048 in / 256 out: fp16 vs uniform:4 vs pagedweight
#   (c) decode tokens/s at batch 1 vs transformers' own FP16 generate (recipes/perf_hf_generate.py)
#   (d) the serving-time cap: batch 1 with memory to spare (pagedweight raises every block to
#       the pack's widest width) with and without --max-bits 4, against uniform:4 / uniform:8
#   (g) decode steps replayed from CUDA graphs against eager steps, batch 1 / 4 / 16, at most
#       4 bits, each policy (POLICIES) and mode in its own process
#   (o) batch-1 decode step (recipes/profile_engine_step.py, at most 4 bits): each policy
#       (POLICIES), then with BASELINE=DIR (an older tree's pwctl, e.g. `git archive` of a
#       commit before the planner's work overlapped the step) the same from that tree; then the
#       graphs captured with each SDPA backend (capture seconds, step time); then
#       recipes/perf_sdpa_shapes.py
# Every figure is `pwctl bench --throughput` on the serving engine; one process per policy, so
# torch.cuda.max_memory_allocated is that policy's alone. pagedweight's BUDGET is uniform:4's
# plane bytes (equal expert memory at peak pressure).
# Usage (device tool, one stage per call, each well under 10 minutes):
#   bash recipes/perf_serving_gpu.sh prep; bash recipes/perf_serving_gpu.sh a; ... b; ... c
# SHAPE (default qwen-moe; mixtral, qwen3-moe: pwctl.bench.synthetic.SHAPES).
# LAYERS (default 8): Qwen1.5-MoE has 24; 24 layers need ~62 GB of disk (bf16 checkpoint + 8-bit
# planes + fp16 reference), too close to the 1-GPU machine's 64 GB.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
LAYERS=${LAYERS:-8}
SHAPE=${SHAPE:-qwen-moe}
CK=${CK:-/tmp/qwen-moe-ckpt}
PACK=${PACK:-/tmp/qwen-moe-pack}
IO=(--input-len 2048 --output-len 256)
mkdir -p "$OUT"

budget() { python3 -m pwctl.bench.serving_budget "$PACK" --dtype float16 "$@"; }

case "${1:-}" in
prep)
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip -e failed"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -m pwctl.bench.synthetic "$CK" --shape "$SHAPE" --layers "$LAYERS"
  pwctl convert "$CK" "$PACK" --device cuda --force --json "$OUT/convert_qwen_moe.json" | tail -5
  # budgeted policies need a profile; proxy = no KL sweep (the weights are synthetic anyway)
  pwctl profile "$PACK" --method proxy --samples 4 --seq-len 256 --device cuda | tail -3
  df -h /tmp | tail -1
  ;;
a)
  PLANES4=$(budget --what planes --planes uniform:4)
  MEM_A=$(budget --planes uniform:4 --seqs 4 --tokens 2304 --max-seqs 4)
  echo "(a) memory budget $MEM_A, pagedweight BUDGET $PLANES4"
  for P in uniform:4 "pagedweight:$PLANES4"; do
    pwctl bench "$PACK" --throughput --device cuda "${IO[@]}" --batch 1 --batch 4 --max-seqs 4 \
      --memory-budget "$MEM_A" --policy "$P" --json "$OUT/serve_a_${P%%:*}.json"
  done
  ;;
b)
  PLANES4=$(budget --what planes --planes uniform:4)
  MEM_B=$(budget --planes fp16 --seqs 4 --tokens 2304 --max-seqs 32)
  echo "(b) memory budget $MEM_B (fp16 + KV of 4 x 2304 tokens), pagedweight BUDGET $PLANES4"
  for P in fp16 uniform:4 "pagedweight:$PLANES4"; do
    pwctl bench "$PACK" --throughput --device cuda "${IO[@]}" --concurrency 32 --requests 64 \
      --max-seqs 32 --memory-budget "$MEM_B" --policy "$P" --json "$OUT/serve_b_${P%%:*}.json"
  done
  ;;
c)
  PLANES4=$(budget --what planes --planes uniform:4)
  for P in fp16 uniform:4 "pagedweight:$PLANES4"; do
    pwctl bench "$PACK" --throughput --device cuda "${IO[@]}" --batch 1 --policy "$P" \
      --json "$OUT/serve_c_${P%%:*}.json"
  done
  python3 recipes/perf_hf_generate.py "$CK" "${IO[@]}" --json "$OUT/serve_c_hf_generate.json"
  ;;
d)
  D=(--input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-128}" --batch 1)
  pwctl bench "$PACK" --throughput --device cuda "${D[@]}" --policy fp16 --policy uniform:4 \
    --policy uniform:8 --policy pagedweight:0.3 --json "$OUT/serve_d.json"
  pwctl bench "$PACK" --throughput --device cuda "${D[@]}" --policy pagedweight:0.3 \
    --max-bits 4 --json "$OUT/serve_d_max_bits_4.json"
  ;;
g)
  G=(--input-len "${INPUT_LEN:-512}" --output-len "${OUTPUT_LEN:-128}" --batch 1 --batch 4
     --batch 16 --max-bits 4)
  for MODE in cuda-graphs eager; do  # one process a policy: no first-run costs shared
    for P in ${POLICIES:-uniform:4 pagedweight:0.3}; do
      pwctl bench "$PACK" --throughput --device cuda "${G[@]}" --policy "$P" "--$MODE" \
        --json "$OUT/serve_g_${MODE}_${P%%:*}.json"
    done
  done
  ;;
o)
  step() {  # name, policy, extra arguments
    local name=$1 policy=$2
    shift 2
    timeout 120 python3 recipes/profile_engine_step.py "$PACK" "$policy" 32 --max-bits 4 "$@" \
      >"$OUT/step_$name.log" 2>&1
    echo "$name $policy $*: rc $?"
    grep -E "decode graphs|decode step wall|profiled" "$OUT/step_$name.log"
  }
  for P in ${POLICIES:-uniform:4 pagedweight:0.3}; do
    step "${P%%:*}" "$P"
    if [ -n "${BASELINE:-}" ]; then
      PYTHONPATH=$BASELINE step "baseline_${P%%:*}" "$P"
    fi
  done
  for B in cudnn efficient math; do
    step "sdpa_$B" uniform:4 --graph-sdpa "$B"
  done
  timeout 120 python3 recipes/perf_sdpa_shapes.py
  ;;
*)
  echo "usage: bash recipes/perf_serving_gpu.sh prep|a|b|c|d|g|o" >&2
  exit 2
  ;;
esac
