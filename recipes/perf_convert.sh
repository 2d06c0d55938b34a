#!/usr/bin/env bash
# Device run for docs/PERF.md (issue 2): the test suite under the GPU machine's transformers,
# then GPU conversion of a real-shape Mixtral layer with synthetic weights, then the quantizer
# comparison at Mixtral width. Usage (device tool): bash recipes/perf_convert.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip -e failed"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -x -n 8 tests -p no:cacheprovider 2>&1 | tail -4
python3 -m pwctl.bench.synthetic /tmp/mix --shape mixtral --layers 1
du -sh /tmp/mix
/usr/bin/time -v pwctl convert /tmp/mix /tmp/mixpack --device cuda --json "$OUT/convert_mixtral_gpu.json" \
  2> "$OUT/time_gpu.txt" | tail -14
grep -E "Maximum resident|Elapsed" "$OUT/time_gpu.txt"
pwctl bench --quantizer --device cuda --rows 4096 --cols 4096 --json "$OUT/quantizer_gpu.json" | tail -26
