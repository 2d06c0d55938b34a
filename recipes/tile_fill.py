"""How full the sm_90a prefill's 128-token tiles are on random routing like the kernel bench's
(CPU generator, a few seeds): real tokens over tile capacity. No GPU needed. Usage:
  python recipes/tile_fill.py [tokens ...]"""

from __future__ import annotations

import sys

from pwctl.bench.kernels import SHAPES, random_routing
from pwctl.runtime.fused_moe import TILE_TOKENS, group, tile_plan


def main() -> None:
    tokens = [int(t) for t in sys.argv[1:]] or [256, 512, 2048]
    for name, spec in SHAPES.items():
        for T in tokens:
            tiles = pairs = 0
            for seed in range(5):
                _, w, idx, _ = random_routing(spec, T, device="cpu", seed=seed)
                plan = tile_plan(group(idx, w, spec.num_experts))
                tiles += int((plan.info[:, 0] >= 0).sum())
                pairs += idx.numel()
            print(f"{name:10s} {T:5d} tokens: {tiles / 5:6.1f} tiles, "
                  f"{pairs / (tiles * TILE_TOKENS):.0%} of their rows real")  # fmt: skip


if __name__ == "__main__":
    main()
