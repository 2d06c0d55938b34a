#!/usr/bin/env bash
# Nsight Compute profile of the fused MoE kernels on one synthetic layer: time, pipes, occupancy,
# DRAM and the warp-stall breakdown (per issued instruction) that docs/PERF.md quotes.
# Usage (GPU machine): bash tools/kernel-dev/perf_kernel_ncu.sh SHAPE WIDTH TOKENS [variant_dir ...]
#   KRE=prefill bash tools/kernel-dev/perf_kernel_ncu.sh mixtral 3 512     (kernel-name regex; default decode)
# Each variant is a folder of sources, a variant of cuda/ (PWCTL_CUDA_DIR for its run).
set -uo pipefail
shape=$1 width=$2 tokens=$3
shift 3
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(cuda)
kre=${KRE:-gate_up_n|down_n}
stalls=""
for r in long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle barrier \
    not_selected selected dispatch_stall no_instruction branch_resolving; do
    stalls="$stalls,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
metrics="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
metrics="$metrics,sm__warps_active.avg.pct_of_peak_sustained_active"
metrics="$metrics,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum"
metrics="$metrics,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"
metrics="$metrics,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"
metrics="$metrics,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
metrics="$metrics,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,lts__t_sector_hit_rate.pct$stalls"
for v in "${variants[@]}"; do
    echo "== $v $shape width $width tokens $tokens"
    PWCTL_CUDA_DIR=$v /usr/local/cuda/bin/ncu --metrics "$metrics" -k regex:"$kre" -s 2 -c 2 \
        python3 tools/kernel-dev/perf_kernel_ncu.py "$shape" "$width" "$tokens" 2>&1 |
        grep -E "^\s+[a-z_]+ \(|^\s+[a-z]" |
        sed -E 's/ +/ /g; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
done
