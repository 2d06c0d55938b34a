"""Where an eager decode call's host time goes (the engine decodes eagerly): wall time per call
of the MoE layer with the GPU idle behind it, then cProfile's top functions by own time.
Usage (GPU machine): python3 recipes/profile_host.py qwen3-moe,mixtral 1,4"""

from __future__ import annotations

import cProfile
import functools
import pstats
import sys
import time

import numpy as np
import torch

from pwctl.bench.kernels import SHAPES, random_routing, synthetic_layer


def host_us(call, reps: int = 200) -> float:
    """Microseconds of host time per call: the loop's wall time, synchronized once at the end
    (while the GPU is faster than the host, the wall time is the host's)."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        layer.set_widths(np.full(layer.table.n_blocks, 4))
        for T in tokens:
            x, w, idx, sc = random_routing(layer.spec, T, seed=T)
            call = functools.partial(layer.moe, 0, x, w, idx, sc, path="decode")
            print(f"{name} T={T}: {host_us(call):.1f} us a call (host-bound wall time)", flush=True)
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
