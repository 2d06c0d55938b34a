"""Both prefill kernels (sm_90a wgmma and mma.sync) against the FP16 baseline as `bench --kernels`
times it (`grouped_time`), on one synthetic layer per shape, in one process (so the ratios share
the GPU's state). Usage (GPU machine):
  python3 tools/kernel-dev/perf_prefill_kernels.py mixtral,qwen-moe,qwen3-moe 4 256,512,2048"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch

from pwctl.bench.kernels import (
    SHAPES,
    GroupedFp16,
    event_time,
    grouped_time,
    random_routing,
    synthetic_layer,
)
from pwctl.kernels import build


def main() -> None:
    shapes = sys.argv[1].split(",")
    widths = [int(w) for w in sys.argv[2].split(",")]
    tokens = [int(t) for t in sys.argv[3].split(",")]
    kinds = ["mma", "wgmma"] if build.has_wgmma() else ["mma"]
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        for width in widths:
            layer.set_widths(np.full(layer.table.n_blocks, width))
            for T in tokens:
                x, w, idx, sc = random_routing(layer.spec, T, seed=T)
                grouped = grouped_time(GroupedFp16(layer, x, w, idx, sc), decode=False)
                line = f"{name:10s} w{width} T{T:5d} grouped {grouped * 1e6:7.0f} us"
                for kind in kinds:
                    layer.moe.prefill_kernel = kind
                    call = functools.partial(layer.moe, 0, x, w, idx, sc, path="prefill")
                    t = event_time(call, 10)
                    line += f"  {kind} {t * 1e6:7.0f} us ({grouped / t:.2f}x grouped)"
                print(line, flush=True)
        layer = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
