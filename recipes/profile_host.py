"""Where an eager decode call's host time goes (the engine decodes eagerly): wall time per call
of the MoE layer with the GPU idle behind it, then cProfile's top functions by own time.
Usage (GPU machine): python3 recipes/profile_host.py qwen3-moe,mixtral 1,4"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from pwctl.bench.kernels import decode_calls, host_time


def main() -> None:
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    for name, T, call in decode_calls(shapes, tokens):
        print(f"{name} T={T}: {host_time(call) * 1e6:.1f} us of host time a call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            call()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
