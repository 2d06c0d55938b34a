"""Routed decode layers (`FusedMoE.routed`) with gate_up launched under PDL (waiting on the SMs
through route_prep) or plainly (after it), against the share of a wave its grid fills: the data
behind `fused_moe.PDL_MAX_FILL`. Graph replay, us a layer, 4 bits, each setting's plans made
anew. Besides the bench's shapes: olmoe (64 experts top-8, I = 1024), e128-i1280 (128 top-8,
I = 1280) and ds-lite (64 top-6, I = 1408, a 2816-wide shared expert). Usage (GPU machine):
  python3 recipes/perf_pdl_fill.py qwen3-moe,olmoe,e128-i1280,ds-lite,qwen-moe 1,2,4"""

from __future__ import annotations

import math
import sys

from pwctl.bench import kernels as bench
from pwctl.runtime import fused_moe, kernels

EXTRA = {
    "olmoe": bench._spec(2048, 1024, 64, 8),
    "e128-i1280": bench._spec(2048, 1280, 128, 8, norm=True),
    "ds-lite": bench._spec(2048, 1408, 64, 6, shared=2816),
}
SETTINGS = {"pdl": 0.0, "plain": float("inf"), "rule": fused_moe.PDL_MAX_FILL}


def wave_share(moe) -> str:
    """The share of a wave the last routed plan's gate_up grid fills."""
    gate_up = next(iter(moe._routed_plans.values()))[1]
    if not isinstance(gate_up, kernels.Prepared):  # the popc kernels (a closure): several waves
        return "-"
    share = kernels.wave_share(gate_up.name, gate_up.grid, gate_up.block[0], 0)
    return f"{math.prod(gate_up.grid)} CTAs, {100 * share:.0f}%"


def main() -> None:
    bench.SHAPES.update(EXTRA)
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    print(
        f"{'shape':12s} {'T':>3s} {'gate_up grid':>18s} " + " ".join(f"{k:>7s}" for k in SETTINGS)
    )
    for name, T, call in bench.decode_calls(shapes, tokens):
        fn, moe, times = bench.routed_call(call), call.func, []
        for fill in SETTINGS.values():
            fused_moe.PDL_MAX_FILL = fill
            moe._routed_plans.clear()
            times.append(bench._graph_time(fn) * 1e6)
        share = wave_share(moe)
        print(f"{name:12s} {T:3d} {share:>18s} " + " ".join(f"{t:7.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
