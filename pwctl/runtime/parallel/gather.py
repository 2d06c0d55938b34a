"""One object from every rank onto rank 0 (reports: bench's per-rank rows, each rank's metrics).
`torch.distributed.gather_object` pickles the objects between our own ranks, over the group's
connection; nothing is ever read back from a file."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from pwctl.errors import PwctlError


def gather_to_first(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on the group's first rank; None on the others. A
    collective: every rank calls it at the same point."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out: list[Any] | None = [None] * world if rank == 0 else None
    first = 0 if group is None else dist.get_global_rank(group, 0)  # dst is a global rank
    try:
        dist.gather_object(obj, out, dst=first, group=group)
    except RuntimeError as e:  # a peer died or timed out: one line, as the exchange says it
        raise PwctlError(f"rank {rank}: gathering the ranks' reports failed ({e})") from None
    return out
