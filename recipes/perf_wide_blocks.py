"""Routed decode calls on layers of 4-bit blocks with a share of them wider, on each build the
launcher can choose, and on the one its rule takes (`auto`, FusedMoE._popc_kind). One token: the
4-bit popc build (`p1`: wider blocks on its lookup), the 5-bit one (`p1b5`) and the lookup
kernels (`n1`); a few tokens: the popc kernels (`pn`) and the lookup ones (`n`). Graph replays,
L2 cold, us, the best of `rounds`. What the rule for layers with wide blocks rests on
(docs/PERF.md, sessions 39-40).
Usage (GPU machine):
  python3 recipes/perf_wide_blocks.py mixtral,qwen3-moe 5,8 0,0.25,0.5,1 [rounds] [tokens,...]"""

from __future__ import annotations

import sys

import numpy as np
import torch

from pwctl.bench.kernels import SHAPES, _routed, graph_times, random_routing, synthetic_layer
from pwctl.runtime import fused_moe

# build -> (popc_decode, POPC_B5); "auto": the launcher's rule
ONE_TOKEN = {"p1": (True, False), "p1b5": (True, True), "n1": (False, False), "auto": (None, True)}
FEW_TOKENS = {"pn": (True, True), "n": (False, True), "auto": (None, True)}


def main() -> None:
    shapes, wides = sys.argv[1].split(","), [int(w) for w in sys.argv[2].split(",")]
    shares = [float(f) for f in sys.argv[3].split(",")]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    tokens = [int(t) for t in sys.argv[5].split(",")] if len(sys.argv) > 5 else [1]
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        n = layer.table.n_blocks
        for T in tokens:
            x = random_routing(layer.spec, T, seed=0)[0]
            builds = ONE_TOKEN if T == 1 else FEW_TOKENS
            for wide in wides:
                for share in shares:
                    widths = np.full(n, 4)
                    widths[np.random.default_rng(1).permutation(n)[: round(share * n)]] = wide
                    layer.set_widths(widths)
                    best = {k: float("inf") for k in builds}
                    for _ in range(rounds):
                        for build, (popc_on, b5) in builds.items():
                            layer.moe.popc_decode, fused_moe.POPC_B5 = popc_on, b5
                            t = graph_times(_routed(layer.moe, x))[0]
                            best[build] = min(best[build], t)
                    cells = "  ".join(f"{k} {t * 1e6:7.1f}" for k, t in best.items())
                    print(f"{name:10s} {T} tok {wide} bits on {share:4.2f}: {cells}", flush=True)
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
