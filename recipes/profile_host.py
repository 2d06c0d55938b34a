"""Where an eager decode call's host time goes (the engine decodes eagerly): wall time per call
of the MoE layer with the GPU idle behind it, then cProfile's top functions by own time.
Usage (GPU machine): python3 recipes/profile_host.py qwen3-moe,mixtral 1,4"""

from __future__ import annotations

import cProfile
import functools
import pstats
import sys

import numpy as np
import torch

from pwctl.bench.kernels import SHAPES, host_time, random_routing, synthetic_layer


def main() -> None:
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        layer.set_widths(np.full(layer.table.n_blocks, 4))
        for T in tokens:
            x, w, idx, sc = random_routing(layer.spec, T, seed=T)
            call = functools.partial(layer.moe, 0, x, w, idx, sc, path="decode")
            print(f"{name} T={T}: {host_time(call) * 1e6:.1f} us of host time a call", flush=True)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                call()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        layer = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
