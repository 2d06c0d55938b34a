"""Serving on several ranks in step: each rank's engine runs its own requests (data-parallel
attention, its own KV cache), and every MoE layer's exchange needs every rank. So the ranks
step together: each step they agree whether any has work, and a rank whose step ran no forward
(nothing scheduled, or no work left while others have some) joins each layer's exchange with no
tokens. Owners run what they receive on the store or the paged experts (one fused MoE call, the
shared expert left to the senders); the 16-bit experts take no exchange. An engine on a rank's
share of the pack (rank_pack.py) holds the planes of its own experts only, and its placement is
the exchange's. Steps with an exchange
run eagerly: decode graphs would need the exchange padded to fixed sizes.

A rank's planner reads its own tokens' routing over every expert, as on one GPU: with
data-parallel attention its tokens sample the same traffic as every rank's, so each expert's
share of its layer (what hot floors and the planner's weights use) is estimated without another
collective. The pairs an owner receives count its own experts' load exactly, but a share needs
every rank's total beside them: a count a step more to exchange, not done."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.runtime.engine.batcher import Batcher
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import SamplingParams, Sequence
from pwctl.runtime.moe.block import MoEBlock
from pwctl.runtime.parallel.exchange import ExpertExchange
from pwctl.runtime.parallel.placement import ExpertPlacement
from pwctl.runtime.parallel.rank_pack import RankPack


class RankEngine:
    """One rank's engine with its MoE blocks' routed experts exchanged over `group`."""

    def __init__(
        self,
        engine: Engine,
        group: dist.ProcessGroup | None = None,
        placement: ExpertPlacement | None = None,
    ):
        """`placement` (None: the one the engine's pack was cut by, if it is a rank's share,
        else the pack's profile balanced over the group's ranks)."""
        if engine.dense is not None:
            raise PwctlError("--expert-parallel serves planes (the store or the paged experts)")
        self.engine, self.group = engine, group
        self.placement = _placement(engine.pack, group, placement)
        self.exchange = ExpertExchange(self.placement, group)
        self.blocks = [m for m in engine.model.modules() if isinstance(m, MoEBlock)]
        for block in self.blocks:
            block.exchange = self.exchange

    @property
    def batcher(self) -> Batcher:
        """The engine's batcher now (bench builds a fresh one a run), its decode graphs off: a
        step with an exchange runs eagerly (its splits are read on the host)."""
        batcher = self.engine.batcher
        if batcher is None:
            raise PwctlError("start_batching first")
        batcher.runner.graphs = None
        return batcher

    @property
    def has_work(self) -> bool:
        """Whether any rank has work: a collective, so every rank asks once a step (the loops
        that drive a Batcher, `while has_work: step()`, drive this the same way)."""
        return self._anyone_busy(self.batcher.has_work)

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        return self.batcher.add(prompt_ids, params)

    def step(self) -> list[Sequence]:
        """This rank's step (the sequences that got a token), or, where no forward ran here,
        every layer's exchange with no tokens: the others' steps need this rank's experts."""
        batcher = self.batcher
        calls = self.exchange.stats.calls
        got = batcher.step() if batcher.has_work else []
        if self.exchange.stats.calls == calls:
            self.empty_step()
        return got

    def generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """This rank's prompts to completion, stepping with every other rank."""
        seqs = [self.add(p, params) for p in prompts]
        while self.has_work:
            self.step()
        return seqs

    def empty_step(self) -> None:
        """Every MoE layer's exchange, in layer order, with no tokens of this rank."""
        spec = self.blocks[0].spec if self.blocks else None
        if spec is None:
            return
        x = torch.empty(0, spec.hidden, dtype=self.engine.dtype, device=self.engine.device)
        index = torch.empty(0, spec.top_k, dtype=torch.long, device=x.device)
        weights = torch.empty(0, spec.top_k, dtype=torch.float32, device=x.device)
        for block in self.blocks:  # as owners they still run what the others send
            block.exchanged(x, weights, index)

    def _anyone_busy(self, busy: bool) -> bool:
        flag = torch.tensor([int(busy)], device=self.engine.device)  # NCCL: on the GPU
        try:
            dist.all_reduce(flag, dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as e:  # a peer died or timed out: one line, as the exchange says it
            rank = dist.get_rank(self.group)
            raise PwctlError(f"rank {rank}: the ranks could not agree on a step ({e})") from None
        return bool(flag.item())


def _placement(
    pack: Pack, group: dist.ProcessGroup | None, placement: ExpertPlacement | None
) -> ExpertPlacement:
    """Who runs which expert: a rank's share of the pack holds the blocks of its placement
    only, so the exchange follows that one (for the rank it was cut for); a whole pack follows
    `placement`, or the profile's balanced over the group."""
    if not isinstance(pack, RankPack):
        return placement or ExpertPlacement.for_pack(pack, dist.get_world_size(group))
    rank = dist.get_rank(group)
    if placement is not None and not np.array_equal(placement.owner, pack.placement.owner):
        raise PwctlError("the engine holds its own pack's placement: give RankEngine no other")
    if (pack.rank, pack.placement.ranks) != (rank, dist.get_world_size(group)):
        raise PwctlError(
            f"rank {rank}: the engine holds rank {pack.rank}'s share of "
            f"{pack.placement.ranks} ranks, the group has {dist.get_world_size(group)}"
        )
    return pack.placement
