#!/usr/bin/env bash
# Where one fused kernel's warps wait, instruction by instruction: Nsight Compute's source page
# (SASS) for one launch on a synthetic layer, summarized by tools/kernel-dev/ncu_stalls.py (stall
# reasons over all samples, then the most-sampled instructions with their top reasons).
# Usage (GPU machine): bash tools/kernel-dev/perf_kernel_stalls.sh KERNEL SHAPE WIDTH TOKENS [CUBIN]
#   e.g. bash tools/kernel-dev/perf_kernel_stalls.sh gate_up_prefill_wg mixtral 4 512 build/whole.cubin
set -u
kernel=$1 shape=$2 width=$3 tokens=$4
[ $# -ge 5 ] && export PWCTL_CUBIN=$PWD/$5
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ncu=/usr/local/cuda/bin/ncu
$ncu --clock-control none -k regex:"^$kernel\$" -s 1 -c 1 --section SourceCounters \
    --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section SpeedOfLight -o /tmp/stalls -f \
    python3 tools/kernel-dev/perf_kernel_ncu.py "$shape" "$width" "$tokens" >/dev/null 2>&1
$ncu -i /tmp/stalls.ncu-rep --page details 2>&1 |
    grep -E "Duration|Throughput|Busy|Hit Rate|Issue|Eligible|Active Warps" | sed -E 's/ +/ /g'
$ncu -i /tmp/stalls.ncu-rep --page source --csv --print-source sass >/tmp/stalls.csv 2>/dev/null
python3 tools/kernel-dev/ncu_stalls.py /tmp/stalls.csv 45
