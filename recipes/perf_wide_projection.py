"""Where a wide block costs a one-token call: every routed expert's gate, up or down block (or all
three) at `wide` bits, the rest at 4, on the one-token builds (perf_wide_blocks.py's `p1`, `p1b5`,
`n1`, `auto`). Every call reads the wide projection, so a cell shows its whole cost; the shared
expert stays at 4 bits. Graph replays, L2 cold, us, averaged over `seeds` routings.
Usage (GPU machine):
  python3 recipes/perf_wide_projection.py mixtral,qwen-moe 5,8 [seeds]"""

from __future__ import annotations

import sys

import numpy as np
import torch
from perf_wide_blocks import ONE_TOKEN, mean_times, use_build

from pwctl.bench.kernels import SHAPES, _routed, random_routing, synthetic_layer

PROJECTIONS = {"gate": [0], "up": [1], "down": [2], "gate+up": [0, 1], "all": [0, 1, 2]}


def main() -> None:
    shapes, wides = sys.argv[1].split(","), [int(w) for w in sys.argv[2].split(",")]
    seeds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        routed = layer.moe._layer_blocks[0].reshape(-1, 3)[: layer.spec.num_experts]
        for wide in wides:
            for label, cols in {"none": [], **PROJECTIONS}.items():
                widths = np.full(layer.table.n_blocks, 4)
                widths[routed[:, cols].ravel()] = wide
                mean, chose = mean_times(layer, 1, lambda seed, w=widths: w, ONE_TOKEN, 1, seeds)
                cells = "  ".join(f"{k} {t * 1e6:7.1f}" for k, t in mean.items())
                print(f"{name:10s} {wide} bits, {label:7s}: {cells} ({chose})", flush=True)
                for build in ("p1", "n1", "n1p1"):
                    split = kernel_times(layer, build)
                    cells = "  ".join(f"{k} {us:.1f}" for k, us in split.items())
                    print(f"    {build}: {cells}")
        del layer
        torch.cuda.empty_cache()


def kernel_times(layer, build: str, calls: int = 5) -> dict[str, float]:
    """Each kernel's mean device time, us, in eager one-token routed calls on `build` (routing
    seed 0; torch's profiler)."""
    use_build(layer, ONE_TOKEN[build])
    call = _routed(layer.moe, random_routing(layer.spec, 1, seed=0)[0])
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    use_build(layer, ONE_TOKEN["auto"])
    times = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count >= calls:
            times[e.key] = e.device_time_total / e.count
    return times


if __name__ == "__main__":
    main()
