"""Routed decode calls on layers of 4-bit blocks with a share of them wider, on each build the
launcher can choose, and on the one its rule takes (`auto`, FusedMoE.decode_builds; the builds it
chose are printed last). One token: the 4-bit popc build (`p1`: wider blocks on its lookup),
the 5-bit one (`p1b5`), the lookup kernels (`n1`) and the lookup gate_up with the popc down
(`n1p1`); a few tokens: the popc kernels (`pn`) and the lookup ones (`n`). Graph replays, L2
cold, us, the best of `rounds`, averaged over `seeds` draws of the routing and of which blocks
are wide (which of them a call reads moves its time). What the rule for layers with wide blocks
rests on (docs/decisions/034-wide-block-rule.md).
Usage (GPU machine):
  python3 recipes/perf_wide_blocks.py mixtral,qwen3-moe 5,8 0,0.25,0.5,1 [rounds] [tokens] [seeds]
(tokens: a comma-separated list, as the shapes, widths and shares are)"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from pwctl.bench.kernels import SHAPES, graph_times, random_routing, routed_on, synthetic_layer

# build -> (popc_decode, POPC_B5, the decode kind forced or None); "auto": the launcher's rule
ONE_TOKEN = {
    "p1": (True, False, None), "p1b5": (True, True, None), "n1": (False, False, None),
    "n1p1": (False, False, "n1p1"), "auto": (None, True, None),
}  # fmt: skip
FEW_TOKENS = {"pn": (True, True, None), "n": (False, True, None), "auto": (None, True, None)}


def main() -> None:
    shapes, wides = sys.argv[1].split(","), [int(w) for w in sys.argv[2].split(",")]
    shares = [float(f) for f in sys.argv[3].split(",")]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    tokens = [int(t) for t in sys.argv[5].split(",")] if len(sys.argv) > 5 else [1]
    seeds = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        for T, wide, share in itertools.product(tokens, wides, shares):
            mean, chose = _cell(layer, T, wide, share, rounds, seeds)
            cells = "  ".join(f"{k} {t * 1e6:7.1f}" for k, t in mean.items())
            print(f"{name:10s} {T} tok {wide} bits on {share:4.2f}: {cells} ({chose})", flush=True)
        del layer
        torch.cuda.empty_cache()


def _cell(layer, T: int, wide: int, share: float, rounds: int, seeds: int) -> tuple[dict, set]:
    """Every block at 4 bits but `share` of them, drawn by seed, at `wide`: `mean_times`."""
    n = layer.table.n_blocks
    widths_of = lambda seed: wide_widths(n, wide, share, seed)  # noqa: E731
    return mean_times(layer, T, widths_of, ONE_TOKEN if T == 1 else FEW_TOKENS, rounds, seeds)


def wide_widths(
    n: int, wide: int, share: float, seed: int, among: np.ndarray | None = None
) -> np.ndarray:
    """n blocks at 4 bits but `share` of them (of the blocks `among`, default all), drawn by
    seed, at `wide`."""
    pool = np.arange(n) if among is None else among.ravel()
    widths = np.full(n, 4)
    widths[np.random.default_rng(seed + 1).permutation(pool)[: round(share * pool.size)]] = wide
    return widths


def mean_times(
    layer, T: int, widths_of: Callable[[int], np.ndarray], builds: dict, rounds: int, seeds: int
) -> tuple[dict[str, float], set[str]]:
    """Each build's best time of `rounds` averaged over `seeds` draws (routing `seed`, widths
    `widths_of(seed)`), and the builds the rule chose on them."""
    mean, chose = dict.fromkeys(builds, 0.0), set()
    for seed in range(seeds):
        x = random_routing(layer.spec, T, seed=seed)[0]
        layer.set_widths(widths_of(seed))
        use_build(layer, ONE_TOKEN["auto"])
        chose.add(layer.moe.decode_builds(T)[0][0])
        for build, t in best_times(layer, x, builds, rounds).items():
            mean[build] += t / seeds
    return mean, chose


def best_times(layer, x: torch.Tensor, builds: dict, rounds: int) -> dict[str, float]:
    """Each build's best time of `rounds` on this routing and these widths."""
    best = dict.fromkeys(builds, float("inf"))
    for _ in range(rounds):
        for build, spec in builds.items():
            use_build(layer, spec)
            best[build] = min(best[build], graph_times(routed_on(layer.moe, x))[0])
    use_build(layer, ONE_TOKEN["auto"])
    return best


def use_build(layer, spec: tuple) -> None:
    """Set the layer's launcher to a build of ONE_TOKEN / FEW_TOKENS."""
    popc_on, b5, kind = spec
    rules = replace(layer.moe.rules, popc_decode=popc_on, popc_b5=b5, decode_kind=kind)
    layer.moe.rules = rules


if __name__ == "__main__":
    main()
