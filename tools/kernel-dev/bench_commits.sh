#!/usr/bin/env bash
# `bench --kernels` of this checkout against another commit's tree, on one machine in one call,
# rounds interleaved (base, then this checkout, each round), then bench_compare.py: the rows more
# than 3% slower here (issue 63's check of the split against the commit before it). Each side's
# first build compiles its kernels (NVRTC, ~2 min on 16 cores) into CuPy's cache: run it twice on
# a warm machine and take the second call's comparison (both sides cached, 2 rounds in 600 s).
# -P: python -m would put the working directory (this checkout) first on sys.path, before
# PYTHONPATH, and every side would import this checkout.
# Usage (GPU machine): bash tools/kernel-dev/bench_commits.sh BASE_DIR [rounds] [bench options]
#   BASE_DIR: the other commit's pwctl/ and cuda/, e.g. `mkdir -p .carry/base && git archive
#   b72610e pwctl cuda | tar -x -C .carry/base` (carried to the device); default options: the
#   decode targets' shapes at 3 and 4 bits, 1 and 4 tokens, and 512 (prefill)
set -uo pipefail
base=$(realpath "$1") rounds=${2:-2}
shift $(($# < 2 ? $# : 2))
opts=("$@")
[ ${#opts[@]} -eq 0 ] && opts=(--shape mixtral --shape qwen-moe --shape qwen3-moe --width 3
    --width 4 --tokens 1 --tokens 4 --tokens 512)
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
source recipes/cupy_cache.sh  # both sides' kernels from a carried cache: no compile
# Older trees import LongBench's metric libraries at `bench` import time; `bench --kernels` never
# calls them, and the GPU machine lacks jieba: empty stand-ins, on the base side's path only.
stubs=/tmp/base_stubs
mkdir -p "$stubs/fuzzywuzzy"
echo 'def setLogLevel(level): pass' >"$stubs/jieba.py"
echo 'class Rouge: pass' >"$stubs/rouge.py"
touch "$stubs/fuzzywuzzy/__init__.py"
echo 'def __getattr__(name): return lambda fn: fn' >"$stubs/fuzzywuzzy/utils.py"  # decorators
for r in $(seq "$rounds"); do
    for side in base head; do
        path=$PWD
        [ $side = base ] && path=$base:$stubs
        PYTHONPATH=$path python3 -P -m pwctl.cli bench --kernels "${opts[@]}" \
            --json "$out/bench_$side$r.json" >/dev/null 2>"$out/bench_$side$r.log" ||
            { echo "$side round $r failed"; tail -5 "$out/bench_$side$r.log"; }
    done
done
python3 tools/kernel-dev/bench_compare.py "$(ls "$out"/bench_base*.json | paste -sd, -)" \
    "$(ls "$out"/bench_head*.json | paste -sd, -)" --slower 3
rc=$?
save_cupy_cache
exit $rc
