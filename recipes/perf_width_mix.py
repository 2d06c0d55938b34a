"""Routed decode calls on a layer whose blocks take a mix of widths (a histogram, as the planner
leaves them at a budget), on each build the launcher can choose and on its rule's (`auto`,
FusedMoE.decode_builds; the builds it chose printed last), against every block at 4 bits. Graph
replays, L2 cold, us, averaged over `seeds` draws of the routing and of which block takes which
width. What a pagedweight budget costs decode (docs/PERF.md).
Usage (GPU machine):
  python3 recipes/perf_width_mix.py mixtral,qwen3-moe 3:0.2,4:0.3,5:0.5 [tokens] [seeds]
  python3 recipes/perf_width_mix.py qwen-moe gate=4:0.5,5:0.5+up=4:1+down=6:0.5,7:0.5
(a mix: width:share pairs over every block, or one mix a projection, joined by "+", as
`planner_widths.py` prints them; tokens: a comma-separated list)"""

from __future__ import annotations

import sys

import numpy as np
import torch
from perf_wide_blocks import FEW_TOKENS, ONE_TOKEN, mean_times

from pwctl.bench.kernels import SHAPES, synthetic_layer
from pwctl.format.recipe import (
    PROJECTIONS,  # a layer's blocks are expert-major: [expert, 3], this order
)


def parse_mix(text: str) -> dict[str | None, dict[int, float]]:
    """ "width:share,width:share" as {None: {width: share}} (every block), or
    "gate=...+up=...+down=..." as {projection: {width: share}}."""

    def one(part: str) -> dict[int, float]:
        return {int(w): float(v) for w, v in (pair.split(":") for pair in part.split(","))}

    if "=" not in text:
        return {None: one(text)}
    mixes = dict(part.split("=") for part in text.split("+"))
    if set(mixes) != set(PROJECTIONS):
        raise ValueError(f"a mix by projection names each of {PROJECTIONS} once: {text!r}")
    return {p: one(m) for p, m in mixes.items()}


def layer_widths(blocks: np.ndarray, mixes: dict[str | None, dict[int, float]], seed: int):
    """The widths of a layer's blocks (`blocks`: ids, expert-major [expert, 3]) drawn from
    `parse_mix`'s mixes: over every block, or over each projection's blocks."""
    widths = np.zeros(blocks.size, dtype=np.int64)
    for proj, mix in mixes.items():
        ids = blocks.ravel() if proj is None else blocks[:, PROJECTIONS.index(proj)]
        widths[ids] = mix_widths(ids.size, mix, seed)
    return widths


def mix_widths(n: int, mix: dict[int, float], seed: int) -> np.ndarray:
    """n widths in the mix's proportions (rounded; the rest at the most common width),
    shuffled by seed."""
    counts = {w: round(share * n) for w, share in mix.items()}
    common = max(mix, key=mix.get)
    counts[common] += n - sum(counts.values())
    widths = np.concatenate([np.full(c, w) for w, c in counts.items()])
    return np.random.default_rng(seed + 1).permutation(widths)


def main() -> None:
    shapes = sys.argv[1].split(",")
    mix = parse_mix(sys.argv[2])
    tokens = [int(t) for t in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1]
    seeds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        for T in tokens:
            mean, chose = _cell(layer, T, mix, seeds)
            cells = "  ".join(f"{k} {t * 1e6:7.1f}" for k, t in mean.items())
            print(f"{name:10s} {T} tok: {cells} ({chose})", flush=True)
        del layer
        torch.cuda.empty_cache()


def _cell(layer, T: int, mix: dict, seeds: int) -> tuple[dict, set]:
    """Each build's time on the mix and the rule's on 4 bits (`mean_times`); the builds the
    rule chose on the mix."""
    builds = ONE_TOKEN if T == 1 else FEW_TOKENS
    n, blocks = layer.table.n_blocks, layer.moe.block_ids[0].cpu().numpy()
    widths_of = lambda seed: layer_widths(blocks, mix, seed)  # noqa: E731
    mean, chose = mean_times(layer, T, widths_of, builds, 1, seeds)
    four = mean_times(layer, T, lambda seed: np.full(n, 4), {"auto": builds["auto"]}, 1, seeds)
    return {**mean, "4 bits": four[0]["auto"]}, chose


if __name__ == "__main__":
    main()
