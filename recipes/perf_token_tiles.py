"""The sm_90a prefill with its token tiles from the `token_tiles` kernel against the torch
gather + permute (`wgmma_tiles`) it replaced, one process, best of 2 rounds of 10 calls, 4 bits.
Usage (GPU machine): python3 recipes/perf_token_tiles.py"""

from __future__ import annotations

import functools

import numpy as np
import torch

from pwctl.bench.kernels import (
    SHAPES,
    GroupedFp16,
    _event_time,
    grouped_time,
    random_routing,
    synthetic_layer,
)
from pwctl.runtime import fused_moe


def torch_tiles(x, wpad, pairs, info):
    """`fused_moe.token_tiles` in torch, same arguments (`info` is tile_plan(pairs).info)."""
    plan = fused_moe.tile_plan(pairs)
    return fused_moe.wgmma_tiles(x, wpad, pairs.token[plan.pair].long())


def main() -> None:
    kinds = {"torch tiles": torch_tiles, "token_tiles": fused_moe.token_tiles}
    cases = [("mixtral", 512), ("mixtral", 2048), ("qwen-moe", 2048), ("qwen3-moe", 512)]
    for name, T in cases + [("qwen3-moe", 2048)]:
        layer = synthetic_layer(SHAPES[name], seed=0)
        layer.set_widths(np.full(layer.table.n_blocks, 4))
        x, w, idx, sc = random_routing(layer.spec, T, seed=T)
        grouped = grouped_time(GroupedFp16(layer, x, w, idx, sc), decode=False)
        call = functools.partial(layer.moe, 0, x, w, idx, sc, path="prefill")
        best: dict[str, float] = {}
        for _ in range(2):
            for label, fn in kinds.items():
                fused_moe.token_tiles = fn  # the call looks it up in the module
                best[label] = min(best.get(label, 1e9), _event_time(call, 10))
        fused_moe.token_tiles = kinds["token_tiles"]
        cells = "  ".join(f"{k} {v * 1e6:7.0f} us ({grouped / v:.2f}x)" for k, v in best.items())
        print(f"{name:10s} T{T:5d} grouped {grouped * 1e6:7.0f} us  {cells}", flush=True)
        layer = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
