"""torch.profiler over 5 prefill calls of one synthetic layer (4 bits, sm_90a prefill kernel):
GPU time per kernel and host (CPU) time per op, to see whether a call waits on the host. Usage
(GPU machine): python3 recipes/profile_prefill.py"""

from __future__ import annotations

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pwctl.bench.kernels import SHAPES, random_routing, synthetic_layer


def main() -> None:
    for name, T in (("mixtral", 512), ("qwen3-moe", 2048)):
        layer = synthetic_layer(SHAPES[name], seed=0)
        layer.set_widths(np.full(layer.table.n_blocks, 4))
        x, w, idx, sc = random_routing(layer.spec, T, seed=T)
        layer.moe.prefill_kernel = "wgmma"
        for _ in range(3):
            layer.moe(0, x, w, idx, sc, path="prefill")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                layer.moe(0, x, w, idx, sc, path="prefill")
            torch.cuda.synchronize()
        print("=====", name, T)
        averages = prof.key_averages()
        print(averages.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50))
        print(averages.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=50))
        layer = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
