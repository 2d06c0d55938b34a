"""Where an eager decode call's host time goes (the engine decodes eagerly): wall time per call
of the MoE layer with the GPU idle behind it, then cProfile's top functions by own time.
`routed`: the layer with its router in the first launch (`FusedMoE.routed`, the engine's call)
instead of given routing. Usage (GPU machine):
  python3 recipes/profile_host.py qwen3-moe,mixtral 1,4 [routed]"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from pwctl.bench.kernels import decode_calls, host_time, routed_call


def main() -> None:
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    for name, T, call in decode_calls(shapes, tokens):
        call = routed_call(call) if sys.argv[3:] == ["routed"] else call
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
