"""Where a fused MoE decode call spends its time (NVIDIA GPU): the whole call, the grouping and
input layout alone, and each kernel alone, on one real layer shape with synthetic planes.
Usage: python recipes/perf_kernel_parts.py [--shape mixtral] [--width 4] [--tokens 1]"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from pwctl.bench.kernels import SHAPES, _graph_time, random_routing, synthetic_layer
from pwctl.runtime.fused_moe import fragment_order, group_on_device


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
    parts = {
        "whole call (graph)": lambda: moe(0, x, weights, index, scale),
        "group_on_device + fragment_order (graph)": lambda: (
            group_on_device(index, weights, E),
            fragment_order(x, moe.proj[(0, False, "gate")].wpad),
        ),
    }
    for name, fn in parts.items():
        print(f"{name}: {_graph_time(fn) * 1e6:.1f} us")
    pairs = group_on_device(index, weights, E)
    out = torch.zeros(x.shape[0], x.shape[1], device="cuda")
    t = _graph_time(lambda: moe._decode(0, False, x, pairs, out))
    print(f"_decode: input layout + the two routed-expert kernels (graph): {t * 1e6:.1f} us")


if __name__ == "__main__":
    main()
