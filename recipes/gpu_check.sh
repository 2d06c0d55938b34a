#!/usr/bin/env bash
# First device call of a session: every GPU-marked test (kernels, grouping, pager, paged engine,
# shared KV/plane arena, decode graphs, the sampler), then a short kernel bench (its rows in
# $OUT/kernels.json) and the one-token profile. ~7 min on an H200, of which the NVRTC compile ~1.7
# (give the call 600 s).
# The test files are named: collecting the others needs openai/fastapi, absent on the GPU machine.
# `variants` instead: issues 64/65's kernel variants (GELU-tanh; GPT-OSS's clamped SwiGLU with
# biases and router bias) against torch, the decode graphs of the gpt_oss / gemma4 tiny models,
# and `bench --kernels` on the two shapes (their parts compile at first use: give it 600 s).
# Usage (device tool): bash recipes/gpu_check.sh [variants]
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
source "$(dirname "$0")/cupy_cache.sh"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip -e failed"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${1:-}" = variants ]; then
  timeout 400 python3 -m pytest -q -m gpu -o faulthandler_timeout=300 -p no:cacheprovider \
    tests/test_kernels.py -k "variant_kernels or router_bias_and_top_k or routed_gpt_oss_layer" \
    2>&1 | tail -15
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_graphs.py \
    -k "gpt_oss or gemma4" 2>&1 | tail -8
  timeout 150 pwctl bench --kernels --shape gpt-oss-20b --shape gemma4-26b-a4b --width 3 \
    --width 4 --tokens 1 --tokens 4 --tokens 512 --json "${OUT:-/tmp}/kernels_variants.json" \
    2>&1 | tail -12
  save_cupy_cache
  exit 0
fi
timeout 420 python3 -m pytest -q -s -m gpu -o faulthandler_timeout=200 tests/test_kernels.py tests/test_dense_experts.py tests/test_paged_engine.py tests/test_pager.py tests/test_decode_graphs.py tests/test_scheduler.py tests/test_overlap.py tests/test_allocator_cap.py \
    -p no:cacheprovider 2>&1 | grep -v "Writing model" | tail -25
timeout 210 pwctl bench --kernels --shape mixtral --shape qwen-moe --shape qwen3-moe --width 3 --width 4 \
    --tokens 1 --tokens 2 --tokens 4 --json "${OUT:-/tmp}/kernels.json" 2>&1 | tail -8
# one-token layers, lookup and binary tensor cores (FusedMoE.popc_decode), kernel by kernel
timeout 90 python3 recipes/profile_decode.py mixtral,qwen-moe,qwen3-moe 1 popc 2>&1 | grep -v "Writing model"
save_cupy_cache
