"""Whether an eager prefill call waits on the host: per MoE layer (synthetic planes, 4 bits,
sm_90a prefill), the event time of back-to-back eager calls, the host's own time a call, and the
time of the same call replayed as a CUDA graph (GPU only); the same for the grouped FP16 GEMM
baseline (its graph replay is not meaningful: torch._grouped_mm does host work). With `profile`,
cProfile's top functions of 30 calls. Usage (GPU machine):
  python3 recipes/perf_prefill_host.py mixtral:512,mixtral:2048,qwen3-moe:512 [profile]"""

from __future__ import annotations

import cProfile
import pstats
import sys

import numpy as np
import torch

from pwctl.bench.kernels import (
    SHAPES,
    GroupedFp16,
    _event_time,
    _graph_time,
    host_time,
    random_routing,
    synthetic_layer,
)


def main() -> None:
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in sys.argv[1].split(",")]
    for name, T in cases:
        layer = synthetic_layer(SHAPES[name], seed=0)
        layer.set_widths(np.full(layer.table.n_blocks, 4))
        x, w, idx, sc = random_routing(layer.spec, T, seed=T)
        layer.moe.prefill_kernel = "wgmma"

        def call(layer=layer, x=x, w=w, idx=idx, sc=sc):
            return layer.moe(0, x, w, idx, sc, path="prefill")

        gemm = GroupedFp16(layer, x, w, idx, sc)
        times = (_event_time(call, 10), host_time(call, 20), _graph_time(call, 10))
        ours = [t * 1e6 for t in times]
        base = [t * 1e6 for t in (_event_time(gemm, 10), host_time(gemm, 20))]
        print(
            f"{name} {T}: ours event {ours[0]:.0f} host {ours[1]:.0f} graph {ours[2]:.0f} us | "
            f"grouped FP16 event {base[0]:.0f} host {base[1]:.0f} us | "
            f"x grouped: event {base[0] / ours[0]:.2f}, graph {base[0] / ours[2]:.2f}",
            flush=True,
        )
        if sys.argv[2:] == ["profile"]:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(30):
                call()
            torch.cuda.synchronize()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(16)
        layer = gemm = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
