"""One MoE layer's expert-parallel step: tokens go to their experts' owners and come back.

Every rank routes its own tokens, then (a collective each, in this order on every rank):
1. counts: how many (token, expert) pairs it sends each rank (`all_to_all_single`);
2. the pairs' hidden rows and expert ids, to the owners (uneven splits);
3. the owners' outputs, back along the same splits;
and the sender combines them with its own routing weights (the weights never travel). A rank
with no tokens still joins each collective, with empty splits. Splits are read on the host (on
CUDA a sync a layer), so a step with an exchange runs eagerly (no CUDA graph): fixed-size padded
exchanges would be what graphs need."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pwctl.errors import PwctlError
from pwctl.runtime.parallel.placement import ExpertPlacement

# (hidden rows [n, H], the expert of each row [n]) -> each row's expert output [n, H]: every
# row this rank received, its experts all this rank's, in one call (a fused MoE call groups them)
RunExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def backend_for(device: str) -> str:
    """The collectives' backend for ranks on `device`: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def join(rank: int, world: int, timeout_s: float = 60.0, device: str = "cpu") -> None:
    """This process into the group (MASTER_ADDR / MASTER_PORT from the environment, as torchrun
    sets them) over `backend_for(device)`, with an explicit timeout: a rank that dies makes the
    others' next collective fail within it instead of hanging (under NCCL its watchdog ends the
    process). NCCL's group is bound to this rank's GPU (`device`) at once."""
    backend = backend_for(device)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=torch.device(device) if backend == "nccl" else None,
        )
    except (RuntimeError, ValueError) as e:
        raise PwctlError(f"rank {rank} of {world}: could not join the group ({e})") from None


@dataclass
class ExchangeStats:
    calls: int = 0
    sent_bytes: int = 0  # hidden rows and ids sent to other ranks, and outputs sent back
    seconds: float = 0.0  # wall time inside the collectives

    def since(self, before: ExchangeStats) -> ExchangeStats:
        """What happened after `before` was copied (a bench run's share, warm-up left out)."""
        return ExchangeStats(
            self.calls - before.calls,
            self.sent_bytes - before.sent_bytes,
            self.seconds - before.seconds,
        )


class ExpertExchange:
    """The exchange of one rank; `placement` says who owns what, `group` is the process group
    (None: the default one)."""

    def __init__(self, placement: ExpertPlacement, group: dist.ProcessGroup | None = None):
        self.placement, self.group = placement, group
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != placement.ranks:
            raise PwctlError(
                f"the placement is for {placement.ranks} ranks, the group has "
                f"{dist.get_world_size(group)}"
            )
        # the owner of every (layer, expert), moved to the tokens' device at the first call
        self._owner = torch.as_tensor(placement.owner, dtype=torch.long)
        self.stats = ExchangeStats()

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        index: torch.Tensor,
        run: RunExperts,
    ) -> torch.Tensor:
        """Sum over each token's routed experts, run where they live: float32 [T, H] for x
        [T, H], weights and index [T, k]. `run(rows, experts)` runs what this rank received
        (not called when it received nothing)."""
        T, k = index.shape
        R, H = self.placement.ranks, x.shape[1]
        flat = index.reshape(-1).long()
        if self._owner.device != flat.device:
            self._owner = self._owner.to(flat.device)
        dest = self._owner[layer][flat]
        order = torch.argsort(dest, stable=True)
        tokens = order // k
        send = torch.bincount(dest, minlength=R)
        recv = self._counts(send)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        rows = self._swap(x[tokens], sum(recv_splits), recv_splits, send_splits)
        experts = self._swap(flat[order], sum(recv_splits), recv_splits, send_splits)
        out_rows = run(rows, experts).to(rows.dtype) if rows.shape[0] else torch.zeros_like(rows)
        back = self._swap(out_rows, T * k, send_splits, recv_splits)
        out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        w = weights.reshape(-1)[order].float()
        out.index_add_(0, tokens, back.float() * w[:, None])
        self.stats.calls += 1
        return out

    def _counts(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty_like(send)
        self._timed(lambda: dist.all_to_all_single(recv, send, group=self.group))
        return recv

    def _swap(
        self, t: torch.Tensor, n_out: int, out_splits: list[int], in_splits: list[int]
    ) -> torch.Tensor:
        """`t`'s rows, in_splits[r] of them to rank r; returns the n_out rows received."""
        out = t.new_empty((n_out, *t.shape[1:]))
        self._timed(
            lambda: dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, self.group)
        )
        row = t.shape[1:].numel() * t.element_size()  # bytes a row (an empty t has none)
        self.stats.sent_bytes += (sum(in_splits) - in_splits[self.rank]) * row
        return out

    def _timed(self, fn: Callable[[], object]) -> None:
        start = time.perf_counter()
        try:
            fn()
        except RuntimeError as e:  # a peer died or timed out: say so in one line
            raise PwctlError(f"rank {self.rank}: expert exchange failed ({e})") from None
        self.stats.seconds += time.perf_counter() - start


class SelfExchange(ExpertExchange):
    """A rank's exchange before the ranks have joined (an engine on a rank's share of the pack
    has one from the start: its start-up probe of the largest step runs before RankEngine):
    every (token, expert) pair goes to one of this rank's own experts, so the step does an
    owner's work on the blocks this rank holds and reads no other rank's. Its output is not the
    model's; RankEngine puts the real exchange in its place before anything is served."""

    def __init__(self, placement: ExpertPlacement, rank: int):
        # no ExpertExchange.__init__: there is no group to ask for the rank yet
        self.placement, self.group, self.rank = placement, None, rank
        self.stats = ExchangeStats()
        # this rank's experts of each layer, moved to the tokens' device at the first call (a
        # copy while a decode graph is captured would fail the capture)
        layers = range(placement.owner.shape[0])
        self._mine = [torch.as_tensor(placement.local(rank, layer)) for layer in layers]

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        index: torch.Tensor,
        run: RunExperts,
    ) -> torch.Tensor:
        T, k = index.shape
        if self._mine[layer].device != index.device:
            self._mine = [m.to(index.device) for m in self._mine]
        mine = self._mine[layer]
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        if T and mine.numel():  # (the placement may leave a rank no expert of a layer)
            experts = mine[index.reshape(-1).long() % mine.numel()]
            rows = run(x.repeat_interleave(k, dim=0), experts).float().view(T, k, -1)
            out = (rows * weights.float()[..., None]).sum(1)
        self.stats.calls += 1
        return out
