"""The pack as one rank of --expert-parallel loads it: every block listed in the pack's order (so
block indices, the profile's rows and the router's counts stay the pack's), but the routed
experts the placement gives other ranks are vacant: planes of no bytes, never read from the page
files. What sizes or reads planes from the blocks' plane bytes (the expert store, the page table
and the paged experts' host copy, the memory budget, the plane-bytes metric) then holds and
counts this rank's blocks only, with no expert-parallel code of its own. Vacant blocks follow the
plan's widths at no cost (what chooses kernels by a layer's widths sees them as one rank does);
no token reaches them, as the exchange sends each to its expert's owner."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.format.pack import BlockInfo, Fault, Pack
from pwctl.policy import Kind, Policy
from pwctl.runtime.parallel.exchange import ExpertExchange, SelfExchange
from pwctl.runtime.parallel.placement import ExpertPlacement


class RankPack(Pack):
    """Rank `rank`'s share of `pack` under `placement` (which decides what it holds)."""

    def __init__(self, pack: Pack, placement: ExpertPlacement, rank: int):
        # no Pack.__init__: `pack` has read and checked the manifest once
        self.path, self.placement, self.rank = pack.path, placement, rank
        self._held = placement.holds(rank, pack.blocks)
        self.blocks = [b if h else _vacant(b) for b, h in zip(pack.blocks, self._held, strict=True)]
        self.manifest = replace(pack.manifest, blocks=self.blocks)
        self.index, self.by_name = pack.index, pack.by_name

    @property
    def held(self) -> np.ndarray:
        return self._held

    def read_plane(self, block: BlockInfo, p: int) -> tuple[np.ndarray, np.ndarray | None]:
        """A vacant block's planes are zero bytes long, so reading one reads nothing (the paged
        experts' host copy reads every block's planes into a layout where they take no room)."""
        if self._vacant(block):
            return np.empty(0, dtype="<i4"), None
        return super().read_plane(block, p)

    def load_block(
        self, block: BlockInfo, bits: int
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        self._check_held(block)
        return super().load_block(block, bits)

    def load_good_planes(
        self, block: BlockInfo, bits: int
    ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor], Fault | None]:
        self._check_held(block)
        return super().load_good_planes(block, bits)

    def _vacant(self, block: BlockInfo) -> bool:
        return not self._held[self.by_name[block.name]]

    def _check_held(self, block: BlockInfo) -> None:
        """A vacant block's weights are wanted only if a token reached an expert of another
        rank without the exchange: a routing error, never a read."""
        if self._vacant(block):
            owner = self.placement.owner[block.layer, block.expert]
            raise PwctlError(f"{block.name} is rank {owner}'s expert, not rank {self.rank}'s")


def _vacant(block: BlockInfo) -> BlockInfo:
    """`block` with planes of no bytes (nothing of it is held here; its shape stays, for what
    lays out every block alike) and no reference checksum (its fp16 weights are not read)."""
    empty = [replace(p, bits_nbytes=0, table_nbytes=0, crc32=0) for p in block.planes]
    return replace(block, planes=empty, reference_crc32=None)


def rank_pack(pack: Pack, ranks: int, rank: int, policy: Policy | None) -> Pack:
    """What rank `rank` of `ranks` loads for `policy` (None: `--policy auto`, always planes):
    its share of `pack` (the profile's placement, which RankEngine's exchange then follows);
    the whole pack under fp16, whose reference weights are not planes."""
    if ranks == 1 or (policy is not None and policy.kind is Kind.FP16):
        return pack
    return RankPack(pack, ExpertPlacement.for_pack(pack, ranks), rank)


def own_share(pack: Pack, ranks: int, policy: Policy | None) -> Pack:
    """`rank_pack` for this process's own rank, known before the group is joined (the
    launcher's: `launch.own_rank`), so the pack check and the engine read its blocks only."""
    from pwctl.runtime.parallel.launch import own_rank

    return rank_pack(pack, ranks, own_rank(), policy)


def exchange_before_join(pack: Pack) -> ExpertExchange | None:
    """What a MoE block of an engine on `pack` exchanges through until RankEngine joins the
    ranks: on a rank's share, its own experts only (`SelfExchange`: the engine's start-up probe
    of its largest step then reads no vacant block); on a whole pack, nothing (local experts)."""
    if isinstance(pack, RankPack):
        return SelfExchange(pack.placement, pack.rank)
    return None
