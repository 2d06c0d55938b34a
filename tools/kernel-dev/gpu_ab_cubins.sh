#!/usr/bin/env bash
# Correctness, then speed, of prebuilt cubins of kernel variants: nvcc builds made off the GPU
# machine (`python3 tools/kernel-dev/write_program.py P.cu [--probe NAME]`, then `nvcc
# -arch=sm_90a -std=c++17 -cubin -I VARIANT_DIR -o DIR/NAME.cubin P.cu`), so no NVRTC compile runs
# there. Each cubin must pass the decode kernel tests before its times count.
# Usage (device tool, with DIR carried):
#   bash tools/kernel-dev/gpu_ab_cubins.sh DIR [shapes] [widths] [tokens] [rounds]
#   e.g. bash tools/kernel-dev/gpu_ab_cubins.sh .carry/cubins mixtral,qwen3-moe,qwen-moe 3,4 1,4,16 3
# TESTS: the pytest -k selection of GPU tests (default: the decode ones).
set -uo pipefail
dir=$1 shapes=${2:-mixtral,qwen3-moe,qwen-moe} widths=${3:-3,4} tokens=${4:-1,4,16} rounds=${5:-3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip -e failed"
cubins=$(ls "$dir"/*.cubin | paste -sd, -)
for c in ${cubins//,/ }; do
    echo "== $c"
    PWCTL_CUBIN=$c python3 -m pytest -q -m gpu tests/test_kernels.py -p no:cacheprovider \
        -k "${TESTS:-match_reference or graph_replay or routed_decode or one_token}" 2>&1 | grep -v "Writing model" | tail -3
done
python3 tools/kernel-dev/perf_kernel_ab.py "$cubins" "$shapes" "$widths" "$tokens" "$rounds"
