#!/usr/bin/env bash
# Device run for issue 6 (docs/PERF.md, "Pager on the GPU" and "Planner latency"):
# the CUDA pager backend's correctness tests, promotion bandwidth against a pinned copy measured
# in the same run, the decode-loop slowdown while promotions run, and planner latency.
# Usage (device tool): bash recipes/perf_runtime_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip -e failed"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -s -m gpu tests/test_pager.py -p no:cacheprovider 2>&1 | tail -20
pwctl bench --planner
