"""A decode MoE layer with its router: torch's router (linear, softmax / top-k, the shared gate:
what MoEBlock ran before) then the fused call, against `FusedMoE.routed` (the router folded into
the decode's first launch). Eager time (host included), host time alone and graph-replay time,
us a call, 4 bits. Usage (GPU machine):
  python3 recipes/perf_route.py mixtral,qwen-moe,qwen3-moe 1,4,16"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch
import torch.nn.functional as F

from pwctl.bench.kernels import SHAPES, _event_time, _graph_time, host_time, synthetic_layer
from pwctl.runtime.router import route


def torch_router(moe, spec, gw, sgw, x):
    """What MoEBlock ran before: torch's router and shared gate, then the fused call."""
    weights, index = route(F.linear(x, gw), spec)
    scale = None if sgw is None else torch.sigmoid(F.linear(x, sgw))
    return moe(0, x, weights, index, scale, path="decode")


def main() -> None:
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        layer.set_widths(np.full(layer.table.n_blocks, 4))
        spec, gen = layer.spec, torch.Generator(device="cuda").manual_seed(0)
        E, H = spec.num_experts, spec.hidden
        gw = (torch.randn(E, H, generator=gen, device="cuda") * 0.05).half()
        sgw = (torch.randn(1, H, generator=gen, device="cuda") * 0.05).half()
        sgw = sgw if spec.has_shared else None
        for T in tokens:
            x = torch.randn(T, H, generator=gen, device="cuda").half()
            calls = {
                "torch router": functools.partial(torch_router, layer.moe, spec, gw, sgw, x),
                "fused router": functools.partial(layer.moe.routed, 0, x, gw, sgw),
            }
            line = f"{name:10s} T{T:3d}"
            for label, call in calls.items():
                eager, graph = _event_time(call) * 1e6, _graph_time(call) * 1e6
                host = host_time(call) * 1e6
                line += f"  {label}: eager {eager:6.1f} host {host:6.1f} graph {graph:6.1f}"
            print(line, flush=True)
        layer = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
