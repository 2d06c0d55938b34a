"""Each rank's serving state under --expert-parallel, for reports and /metrics: the part of
`Batcher.metrics()` that differs from rank to rank (each has its own KV cache, and its planner
its own widths) and its side of the all-to-alls, gathered onto rank 0 in rank order."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch.distributed as dist

from pwctl.runtime.engine.batcher import Batcher
from pwctl.runtime.parallel.exchange import ExchangeStats
from pwctl.runtime.parallel.gather import gather_to_first


def rank_metrics(batcher: Batcher, exchange: ExchangeStats) -> dict[str, Any]:
    """This rank's plane and KV bytes now, its widths, width moves and `exchange` counters."""
    m = batcher.metrics()
    return {
        "memory_budget_bytes": m["memory_budget_bytes"],
        "plane_bytes": m["plane_bytes"],
        "kv_bytes": m["kv_blocks_used"] * m["kv_block_bytes"],
        "kv_blocks_used": m["kv_blocks_used"],
        "kv_blocks_limit": m["kv_blocks_limit"],
        "widths_per_layer": m["widths_per_layer"],
        "width_demotions": m["width_demotions"],
        "width_promotions": m["width_promotions"],
        "width_moves": m["width_demotions"] + m["width_promotions"],
        "generated_tokens": m["generated_tokens"],  # by this rank's own requests
        "exchange": asdict(exchange),  # calls, sent_bytes, seconds
    }


def gather_rank_metrics(
    batcher: Batcher, exchange: ExchangeStats, group: dist.ProcessGroup | None = None
) -> list[dict[str, Any]] | None:
    """Every rank's `rank_metrics` (with its rank), on rank 0; None on the others. A
    collective: every rank calls it at the same point."""
    mine = {"rank": dist.get_rank(group), **rank_metrics(batcher, exchange)}
    return gather_to_first(mine, group)
