"""Do the one-token decode kernels' two families load different parts of an SM? The lookup kernels
are bound by their integer work (PRMT), the binary tensor-core ones (popc) by loads in flight a
warp (docs/KERNELS.md). If so, two layers decoded side by side, one on each family, would take
less than the same two on one family. This replays, as one CUDA graph each, two synthetic layers
of a shape at `width` bits, one token: each path alone, and pairs of them on two streams.
Usage (GPU machine): python3 recipes/perf_overlap_probe.py [mixtral] [4]"""

from __future__ import annotations

import sys

import numpy as np
import torch

from pwctl.bench.kernels import SHAPES, _graph_time, random_routing, synthetic_layer


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "mixtral"
    width = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    layers = [synthetic_layer(SHAPES[shape], seed=s) for s in (0, 1)]
    calls = []
    for i, layer in enumerate(layers):
        layer.set_widths(np.full(layer.table.n_blocks, width))
        x, w, idx, sc = random_routing(layer.spec, 1, seed=i)
        calls.append(lambda layer=layer, a=(x, w, idx, sc): layer.moe(0, *a, path="decode"))

    def run(paths: tuple[bool, ...]):
        """Layer i on path paths[i] (True: popc), each on its own stream, joined at the end."""
        side = [torch.cuda.Stream() for _ in paths]

        def step():
            here = torch.cuda.current_stream()  # the capturing stream inside _graph_time
            for s, layer, call, popc in zip(side, layers, calls, paths, strict=False):
                s.wait_stream(here)
                layer.moe.popc_decode = popc
                with torch.cuda.stream(s):
                    call()
            for s in side:
                here.wait_stream(s)

        return _graph_time(step) * 1e6

    cases = {
        "popc": (True,),
        "lookup": (False,),
        "popc | popc": (True, True),
        "lookup | lookup": (False, False),
        "popc | lookup": (True, False),
    }
    for _ in range(2):
        print(shape, width, "  ".join(f"{k}={run(v):7.1f}" for k, v in cases.items()), flush=True)


if __name__ == "__main__":
    main()
