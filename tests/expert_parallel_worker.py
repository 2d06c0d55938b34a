"""One rank of tests/test_expert_parallel.py, run as its own process (as torchrun would start it):
python tests/expert_parallel_worker.py RANK WORLD PORT OUT_DIR MODE. MODE "ok": route this rank's
tokens, run the exchange over two MoE layers, save inputs and outputs (safetensors); "die": rank
1 leaves right after joining, and the others' exchange must fail with a clear error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pwctl.errors import PwctlError
from pwctl.runtime.parallel.exchange import ExpertExchange, join
from pwctl.runtime.parallel.placement import ExpertPlacement

LAYERS, EXPERTS, TOP_K, HIDDEN, WIDTH = 2, 6, 2, 16, 8
TOKENS = (5, 0, 7, 3)  # rank r routes TOKENS[r] tokens (rank 1 none: it still joins)


def experts() -> list[list[torch.Tensor]]:
    """The same expert weights on every rank (seeded): [layer][expert] -> (gate, up, down)."""
    g = torch.Generator().manual_seed(0)
    shapes = ((WIDTH, HIDDEN), (WIDTH, HIDDEN), (HIDDEN, WIDTH))
    return [[[torch.randn(s, generator=g) for s in shapes] for _ in range(EXPERTS)]
            for _ in range(LAYERS)]  # fmt: skip


def mlp(w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    gate, up, down = w
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's x [T, H] and its softmax-top-k routing (weights, index)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS[rank], HIDDEN, generator=g)
    logits = torch.randn(TOKENS[rank], EXPERTS, generator=g)
    weights, index = torch.softmax(logits, -1).topk(TOP_K, -1)
    return x, weights, index


def main() -> None:
    rank, world, port, out, mode = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        sys.argv[5],
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    join(rank, world, timeout_s=10)
    if mode == "die" and rank == 1:
        os._exit(0)  # gone without a word: the others must not hang
    load = torch.rand(LAYERS, EXPERTS, generator=torch.Generator().manual_seed(7)).numpy()
    placement = ExpertPlacement.balanced(load, world)
    exchange, w = ExpertExchange(placement), experts()
    x, weights, index = tokens(rank)
    outs = {}
    for layer in range(LAYERS):

        def run(e: int, rows: torch.Tensor, layer: int = layer) -> torch.Tensor:
            assert placement.owner[layer, e] == rank, "an expert ran on a rank that does not own it"
            return mlp(w[layer][e], rows)

        try:
            outs[f"out{layer}"] = exchange(layer, x, weights, index, run)
        except PwctlError as e:
            print(f"error: {e}", flush=True)
            sys.exit(3)
    save_file(
        {"x": x, "weights": weights, "index": index, **outs}, str(Path(out) / f"rank{rank}.st")
    )
    print(f"sent {exchange.stats.sent_bytes} bytes in {exchange.stats.calls} calls", flush=True)


if __name__ == "__main__":
    main()
