"""What a larger decode tile costs the lookup kernels on the same call (a probe). With the popc
kernels off, each call of the bench's `decode_calls` (given routing) runs on the lookup kernels
of every compiled tile size that holds its slots (`kernels.n_tiles` forced to NT n-tiles of 8
tokens a slot), graph-replayed with L2 cold (`cold_time`); the best median of 3 rounds, us.
Usage (GPU machine):
  python3 recipes/perf_lookup_tiles.py mixtral,qwen3-moe 4,8,16 3,4"""

from __future__ import annotations

import sys

import torch

from pwctl.bench.kernels import capture_graph, cold_time, decode_calls
from pwctl.runtime import fused_moe, kernels


def main() -> None:
    shapes, tokens, widths = (sys.argv[i].split(",") for i in (1, 2, 3))
    fused_moe.POPC_DECODE = False
    n_tiles, best = kernels.n_tiles, {}
    for width in (int(w) for w in widths):
        for name, T, call in decode_calls(shapes, [int(t) for t in tokens], width=width):
            sizes = [nt for nt in (1, 2, 4) if nt >= n_tiles(T)]  # (those session 35 timed)
            for _ in range(3):
                for nt in sizes:
                    kernels.n_tiles = lambda t, nt=nt: nt
                    t = cold_time(capture_graph(call).replay) * 1e6
                    best[(name, width, T, nt)] = min(best.get((name, width, T, nt), t), t)
            kernels.n_tiles = n_tiles
            torch.cuda.synchronize()
    for (name, width, T, nt), t in sorted(best.items()):
        print(f"{name} {width} bits, {T} tokens, {nt} n-tiles: {t:.1f} us")


if __name__ == "__main__":
    main()
