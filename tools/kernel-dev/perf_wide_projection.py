"""Where a wide block costs a one-token call: every routed expert's gate, up or down block (or all
three; or a `share` of those blocks, drawn by seed) at `wide` bits, the rest at 4, on the
one-token builds (perf_wide_blocks.py's `p1`, `p1b5`, `n1`, `n1p1`, `auto`). With every block of
a projection wide each call reads it, so a cell shows its whole cost; the shared expert stays at
4 bits. Also `p1` on one wave of persistent gate_up CTAs in equal shares (`p1
wave`), where by default a layer with a wide block takes one CTA a tile. Graph replays, L2 cold,
us, averaged over `seeds` routings.
Usage (GPU machine; cases: none and the keys of PROJECTIONS, default all; it imports
recipes/perf_wide_blocks.py):
  PYTHONPATH=recipes python3 tools/kernel-dev/perf_wide_projection.py mixtral,qwen-moe 5,8 \
      [seeds] [cases] [shares]"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from perf_wide_blocks import ONE_TOKEN, mean_times, use_build, wide_widths

from pwctl.bench.kernels import SHAPES, random_routing, routed_on, synthetic_layer
from pwctl.kernels import launch

PROJECTIONS = {"gate": [0], "up": [1], "down": [2], "gate+up": [0, 1], "all": [0, 1, 2]}


def main() -> None:
    shapes, wides = sys.argv[1].split(","), [int(w) for w in sys.argv[2].split(",")]
    seeds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    cases = {"none": [], **PROJECTIONS}
    if len(sys.argv) > 4:
        cases = {k: cases[k] for k in sys.argv[4].split(",")}
    shares = [float(f) for f in sys.argv[5].split(",")] if len(sys.argv) > 5 else [1.0]
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        routed = layer.moe.block_ids[0].cpu().numpy()[: layer.spec.num_experts]
        for wide, share, (label, cols) in itertools.product(wides, shares, cases.items()):
            widths_of = functools.partial(
                wide_widths, layer.table.n_blocks, wide, share, among=routed[:, cols]
            )
            mean, chose = mean_times(layer, 1, widths_of, ONE_TOKEN, 1, seeds)
            mean["p1 wave"] = wave_time(layer, widths_of, seeds)
            cells = "  ".join(f"{k} {t * 1e6:7.1f}" for k, t in mean.items())
            print(
                f"{name:10s} {wide} bits, {label:7s} on {share:4.2f}: {cells} ({chose})", flush=True
            )
            if share == 1:  # the profiler's split (one routing): every block of the projection
                for build in ("p1", "n1", "n1p1"):
                    split = kernel_times(layer, build)
                    cells = "  ".join(f"{k} {us:.1f}" for k, us in split.items())
                    print(f"    {build}: {cells}")
        del layer
        torch.cuda.empty_cache()


def wave_time(layer, widths_of: Callable[[int], np.ndarray], seeds: int) -> float:
    """`p1`'s time, s, averaged as `mean_times` does, with gate_up on one wave of persistent CTAs
    (DispatchRules.gate_up_runs)."""
    moe = layer.moe
    rules = moe.rules
    moe.rules = replace(rules, gate_up_runs=launch.resident_ctas("gate_up_p1"))
    try:
        return mean_times(layer, 1, widths_of, {"p1": ONE_TOKEN["p1"]}, 1, seeds)[0]["p1"]
    finally:
        moe.rules = rules


def kernel_times(layer, build: str, calls: int = 5) -> dict[str, float]:
    """Each kernel's mean device time, us, in eager one-token routed calls on `build` (routing
    seed 0; torch's profiler)."""
    use_build(layer, ONE_TOKEN[build])
    call = routed_on(layer.moe, random_routing(layer.spec, 1, seed=0)[0])
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
