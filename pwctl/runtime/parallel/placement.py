"""Which rank owns each routed expert of each MoE layer: the expected router load balanced over
the ranks, with the same number of experts a rank (each rank's planes take the same memory).
Shared experts run on every rank (every token uses them: sending them would only add traffic)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pwctl.errors import PwctlError
from pwctl.format.pack import BlockInfo, Pack
from pwctl.format.profile import PROFILE_JSON, Profile


@dataclass(frozen=True)
class ExpertPlacement:
    owner: np.ndarray  # int32 [moe_layers, experts]: the rank that runs each expert
    ranks: int

    @classmethod
    def balanced(cls, load: np.ndarray, ranks: int) -> ExpertPlacement:
        """Per layer, experts by falling load each to the least loaded rank that still has room
        (ceil(E / ranks) experts a rank): the longest-processing-time rule under equal counts.
        `load` [moe_layers, experts]: e.g. the profile's router share."""
        load = np.asarray(load, dtype=np.float64)
        layers, experts = load.shape
        if not 1 <= ranks <= experts:
            raise PwctlError(f"--expert-parallel {ranks}: needs 1 to {experts} ranks (experts)")
        room = -(-experts // ranks)
        owner = np.empty((layers, experts), dtype=np.int32)
        for layer in range(layers):
            total, count = np.zeros(ranks), np.zeros(ranks, dtype=np.int64)
            for e in np.argsort(-load[layer], kind="stable"):
                open_ = np.flatnonzero(count < room)
                r = open_[np.argmin(total[open_])]
                owner[layer, e] = r
                total[r] += load[layer, e]
                count[r] += 1
        return cls(owner, ranks)

    @classmethod
    def uniform(cls, moe_layers: int, experts: int, ranks: int) -> ExpertPlacement:
        """No profile: every expert expected alike (contiguous-looking counts, balanced)."""
        return cls.balanced(np.ones((moe_layers, experts)), ranks)

    @classmethod
    def for_pack(cls, pack: Pack, ranks: int) -> ExpertPlacement:
        """The profile's router share balanced, or without a profile every expert alike."""
        m = pack.manifest
        if (pack.path / PROFILE_JSON).is_file():
            return cls.balanced(Profile.load(pack).router_share, ranks)
        return cls.uniform(len(m.moe_layers), int(m.spec["num_experts"]), ranks)

    def local(self, rank: int, layer: int) -> np.ndarray:
        """Experts of `layer` that `rank` runs, ascending."""
        return np.flatnonzero(self.owner[layer] == rank)

    def holds(self, rank: int, blocks: list[BlockInfo]) -> np.ndarray:
        """bool [len(blocks)]: the blocks whose planes `rank` needs: those of the routed experts
        it runs, and every shared (or dense) block, which each rank runs for its own tokens.
        A block's layer indexes `owner` as the exchange's does."""
        return np.array([b.shared or self.owner[b.layer, b.expert] == rank for b in blocks], bool)

    def rank_load(self, load: np.ndarray) -> np.ndarray:
        """[moe_layers, ranks]: the share of `load` each rank carries."""
        out = np.zeros((self.owner.shape[0], self.ranks))
        for layer in range(self.owner.shape[0]):
            np.add.at(out[layer], self.owner[layer], np.asarray(load)[layer])
        return out
