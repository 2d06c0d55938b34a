"""Run one MoE layer (synthetic planes, real shape) a few times, for Nsight Compute to profile
the fused kernels. Usage (GPU machine):
  ncu --metrics sm__inst_executed.sum,gpu__time_duration.sum,... -k regex:"gate_up|down" -s 2 -c 2 \
      python3 tools/kernel-dev/perf_kernel_ncu.py mixtral 4 1"""

from __future__ import annotations

import sys

import numpy as np
import torch

from pwctl.bench.kernels import SHAPES, random_routing, synthetic_layer


def main() -> None:
    shape, width, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    layer = synthetic_layer(SHAPES[shape])
    layer.set_widths(np.full(layer.table.n_blocks, width))
    x, weights, index, scale = random_routing(layer.spec, tokens)
    for _ in range(3):
        layer.moe(0, x, weights, index, scale)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
