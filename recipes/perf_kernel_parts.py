"""Where a fused MoE decode call spends its time (NVIDIA GPU): the whole call, the grouping and
input layout alone, and the two kernels alone, on one real layer shape with synthetic planes.
Usage: python recipes/perf_kernel_parts.py [--shape mixtral] [--width 4] [--tokens 1]"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from pwctl.bench.kernels import SHAPES, _graph_time, random_routing, synthetic_layer
from pwctl.runtime.fused_moe import prepare_decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mixtral", choices=sorted(SHAPES))
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1)
    a = ap.parse_args()
    layer = synthetic_layer(SHAPES[a.shape])
    layer.set_widths(np.full(layer.table.n_blocks, a.width))
    x, weights, index, scale = random_routing(layer.spec, a.tokens)
    moe, E = layer.moe, layer.spec.num_experts
    wpad = moe.proj[(0, False, "gate")].wpad
    out = torch.empty(x.shape[0], x.shape[1], device="cuda")
    parts = {
        "whole call (graph)": lambda: moe(0, x, weights, index, scale),
        "prepare_decode: grouping, layout, zeroed output (graph)": lambda: prepare_decode(
            x, index, weights, E, wpad, out
        ),
    }
    for name, fn in parts.items():
        print(f"{name}: {_graph_time(fn) * 1e6:.1f} us")
    pairs, xf = prepare_decode(x, index, weights, E, wpad, out)
    t = _graph_time(lambda: moe._decode(0, xf, pairs, out, None))
    print(f"_decode: the two routed-expert kernels, no shared expert (graph): {t * 1e6:.1f} us")


if __name__ == "__main__":
    main()
