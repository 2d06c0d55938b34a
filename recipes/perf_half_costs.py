"""One-token routed calls on `p1` (the 4-bit popc build: blocks past 4 bits on its lookup) under
several tables of what a wide half tile costs in its persistent shares (fused_moe.WIDE_HALF_COSTS,
cuda/moe.cu `cost_share`), interleaved within each draw. Cells: every block at 4 bits but a share
of them at a wider width (as perf_wide_blocks.py draws them), and mixes (as perf_width_mix.py).
Graph replays, L2 cold, us, averaged over `seeds` draws. What the table rests on (docs/PERF.md,
sessions 41-42).
Usage (GPU machine; a table "5:2,6:3,7:4,8:5", tables split by "/"; "eq": every cost 1, the
widths read and the shares equal; "off": equal shares, no widths read):
  python3 recipes/perf_half_costs.py "eq/5:2,6:3,7:4,8:5" mixtral 5,6,8 0.04,0.08 [seeds] [mixes]
(mixes: width:share pairs, mixes split by "/")"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
from perf_wide_blocks import wide_widths
from perf_width_mix import mix_widths, parse_pairs

from pwctl.bench.kernels import SHAPES, _routed, graph_times, random_routing, synthetic_layer
from pwctl.runtime import fused_moe


def main() -> None:
    tables = sys.argv[1].split("/")
    shapes, wides = sys.argv[2].split(","), [int(w) for w in sys.argv[3].split(",")]
    shares = [float(f) for f in sys.argv[4].split(",")]
    seeds = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    mixes = sys.argv[6].split("/") if len(sys.argv) > 6 else []
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        for label, widths_of in _cells(layer.table.n_blocks, wides, shares, mixes):
            mean = _mean_by_table(layer, tables, widths_of, seeds)
            print(f"{name:10s} {label}: " + "  ".join(f"{t} {us:7.1f}" for t, us in mean.items()))


def _cells(n: int, wides: list[int], shares: list[float], mixes: list[str]) -> list[tuple]:
    """(label, widths by seed) of each share at each wide width, then of each mix."""
    cells = [(f"{w} bits on {s:4.2f}", lambda seed, w=w, s=s: wide_widths(n, w, s, seed))
             for w in wides for s in shares]  # fmt: skip
    for mix in mixes:
        shares = parse_pairs(mix)
        cells.append((mix, lambda seed, m=shares: mix_widths(n, m, seed)))
    return cells


def _mean_by_table(
    layer, tables: list[str], widths_of: Callable[[int], np.ndarray], seeds: int
) -> dict[str, float]:
    """Each table's one-token p1 time, us, averaged over the draws."""
    saved, mean = dict(fused_moe.WIDE_HALF_COSTS), dict.fromkeys(tables, 0.0)
    layer.moe.popc_decode, fused_moe.POPC_B5 = True, False
    try:
        for seed in range(seeds):
            x = random_routing(layer.spec, 1, seed=seed)[0]
            layer.set_widths(widths_of(seed))
            for table in tables:
                costs = {w: 1 for w in saved} if table in ("eq", "off") else parse_pairs(table, int)
                fused_moe.WIDE_HALF_COSTS.update(costs)
                layer.moe.weigh_shares = table != "off"
                layer.moe.forget_launches()
                mean[table] += graph_times(_routed(layer.moe, x))[0] * 1e6 / seeds
    finally:
        fused_moe.WIDE_HALF_COSTS.update(saved)
        layer.moe.popc_decode, fused_moe.POPC_B5, layer.moe.weigh_shares = None, True, True
    return mean


if __name__ == "__main__":
    main()
