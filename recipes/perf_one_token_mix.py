"""One-token routed calls on layers of 4-bit blocks with a share of them wider, each on the
one-token builds the launcher can choose: the 4-bit popc build (`p1`: wider blocks on its lookup),
the 5-bit one (`p1b5`) and the lookup kernels (`n1`), and the one the launcher's rule takes
(`auto`). Graph replays, L2 cold, us, the best of
`rounds`. What FusedMoE._popc_kind's rule for layers with wide blocks rests on (docs/PERF.md).
Usage (GPU machine):
  python3 recipes/perf_one_token_mix.py mixtral,qwen3-moe 5,8 0,0.25,0.5,1 [rounds]"""

from __future__ import annotations

import sys

import numpy as np
import torch

from pwctl.bench.kernels import SHAPES, _routed, graph_times, random_routing, synthetic_layer
from pwctl.runtime import fused_moe

# popc_decode, POPC_B5; "auto": the launcher's rule (FusedMoE._popc_kind)
KINDS = {"p1": (True, False), "p1b5": (True, True), "n1": (False, False), "auto": (None, True)}


def main() -> None:
    shapes, wides = sys.argv[1].split(","), [int(w) for w in sys.argv[2].split(",")]
    shares = [float(f) for f in sys.argv[3].split(",")]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        x = random_routing(layer.spec, 1, seed=0)[0]
        n = layer.table.n_blocks
        for wide in wides:
            for share in shares:
                widths = np.full(n, 4)
                pick = np.random.default_rng(1).permutation(n)[: round(share * n)]
                widths[pick] = wide
                layer.set_widths(widths)
                best = {k: float("inf") for k in KINDS}
                for _ in range(rounds):
                    for kind, (popc_on, b5) in KINDS.items():
                        layer.moe.popc_decode, fused_moe.POPC_B5 = popc_on, b5
                        best[kind] = min(best[kind], graph_times(_routed(layer.moe, x))[0])
                cells = "  ".join(f"{k} {t * 1e6:7.1f}" for k, t in best.items())
                print(f"{name:10s} {wide} bits on {share:4.2f} of the blocks: {cells}", flush=True)
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
