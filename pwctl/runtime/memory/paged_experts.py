"""The paged execution backend of the experts: one page table, a slab arena (CudaBackend on
CUDA, CpuBackend's host arena on the CPU), the pager that moves planes, the device mirror of
widths and slab map, and the fused MoE that reads them (docs/RUNTIME.md).

The engine hands it the planner's widths (`request`) whenever they change and calls `commit`
at every step boundary; `MoEBlock` calls `fused` for the experts of its layer. The widths the
kernels read (`widths`) lag the requested ones while promotions copy.

The slab arena is the one device allocation of planes and KV blocks: the serving engine sizes
it once from its memory budget (`rebuild`), and the KV cache takes slabs out of the pager's pool
(`lend`) and gives them back (`give_back`, reclaimed behind a fence like a demoted plane), so
bytes a demotion frees become KV blocks and KV bytes a finished sequence frees become planes."""

from __future__ import annotations

import numpy as np
import torch

from pwctl.format.pack import Pack
from pwctl.format.recipe import MoESpec
from pwctl.runtime.memory.device_table import DeviceTable
from pwctl.runtime.memory.page_table import IN_FLIGHT, PageTable
from pwctl.runtime.memory.pager import Commit, CpuBackend, CudaBackend, Pager
from pwctl.runtime.moe.fused import FusedMoE


class PagedExperts:
    def __init__(
        self,
        pack: Pack,
        device: str = "cpu",
        budget_bytes: int | None = None,
        max_bits: int | None = None,
    ):
        """`budget_bytes`: the slab pool; default: every block at `max_bits` (the widest width
        served; None: the pack's) in whole slabs, so any plan up to it fits and no promotion
        ever waits for slabs."""
        self.pack, self.device = pack, device
        probe = PageTable.from_pack(pack, 0)  # the slab size and per-width costs only
        self.slab_bytes = probe.slab_bytes
        if budget_bytes is None:
            budget_bytes = self.widest_bytes(probe, max_bits)
        self.table = PageTable.from_pack(pack, budget_bytes, probe.slab_bytes)
        if device.startswith("cuda"):
            self.backend: CpuBackend | CudaBackend = CudaBackend.from_pack(
                pack, self.table, device=device
            )
        else:
            self.backend = CpuBackend.from_pack(pack, self.table)
        self._attach()
        self.moved_bytes = 0  # host -> device bytes of every promotion submitted so far

    @staticmethod
    def widest_bytes(table: PageTable, max_bits: int | None = None) -> int:
        """Device bytes of every block at `max_bits` (None: the pack's widest), in whole slabs."""
        return int(table.cost_at[:, table.max_bits if max_bits is None else max_bits].sum())

    def _attach(self) -> None:
        """Pager, device table and fused MoE over the current page table and backend."""
        if isinstance(self.backend, CudaBackend):
            self.arena = self.backend.slabs
        else:
            self.arena = torch.from_numpy(self.backend.arena)
        self.pager = Pager(self.table, self.backend)
        self.dt = DeviceTable(self.table, self.arena, self.pack.blocks)
        self.fused = FusedMoE(MoESpec(**self.pack.manifest.spec), self.dt, self.pack.index)

    def rebuild(self, budget_bytes: int) -> None:
        """A fresh arena of `budget_bytes // slab_bytes` slabs, every plane on the host and
        nothing lent (the serving engine's start-up; request and settle the widths next). The
        old arena is released first, so device memory never holds both."""
        self.backend.sync()  # no copy may still write the old arena
        host = self.backend.host
        cuda = isinstance(self.backend, CudaBackend)
        self.table = PageTable.from_pack(self.pack, budget_bytes, self.slab_bytes)
        del self.backend, self.pager, self.dt, self.fused, self.arena  # the old arena goes
        if cuda:
            assert isinstance(host, torch.Tensor)  # a CUDA backend's host copy: pinned torch
            torch.cuda.empty_cache()
            self.backend = CudaBackend(host, self.table.n_slabs, self.slab_bytes, self.device)
        else:
            assert isinstance(host, np.ndarray)  # a CPU backend's: numpy
            self.backend = CpuBackend(host, self.table.n_slabs, self.slab_bytes)
        self._attach()

    # --- the pool shared with the KV cache ------------------------------------------------------

    def lend(self, n: int) -> np.ndarray | None:
        """`n` free (reclaimed) slabs for the KV cache, or None."""
        return self.pager.lend(n)

    def give_back(self, ids: np.ndarray) -> None:
        """KV slabs back to the pool, behind a fence (kernels may still read them)."""
        self.pager.give_back(ids)

    def reclaim(self) -> None:
        """Make demotions requested since the last commit real now (between steps, e.g. while
        scheduling): commit without promoting, wait for the fences, reclaim. Afterwards every
        slab the plan and the KV cache do not hold is free."""
        self.pager.commit(promote=False)
        self.pager.drain()
        self.dt.sync()

    def drain(self) -> None:
        """Wait for kernels and copies and reclaim what they held (nothing commits)."""
        self.pager.drain()

    @property
    def arena_bytes(self) -> int:
        return self.table.n_slabs * self.slab_bytes

    def plane_cost(self, widths: np.ndarray) -> int:
        """Device bytes of planes at `widths`: whole slabs (PageTable.cost_at)."""
        return int(self.table.cost_of(widths).sum())

    def committed_bytes(self, widths: np.ndarray) -> int:
        """Device bytes planes hold or will hold: per block the larger of its cost at `widths`
        (the plan) and the slabs it holds now (resident, in flight, retiring), plus the slabs
        of cancelled copies that are still writing."""
        t = self.table
        plan = t.cost_of(widths)
        cancelled = self.pager.cancelled_slabs()
        held = self._held_slabs() * t.slab_bytes
        return int(np.maximum(plan, held).sum()) + cancelled * t.slab_bytes

    def _held_slabs(self) -> np.ndarray:
        """Per block, the slabs its planes hold now: a count over its range of the slab map
        (empty for a block with no bytes here: parallel/rank_pack.py)."""
        t = self.table
        taken = np.concatenate([[0], np.cumsum(t.slab_map >= 0)])
        start = t.slab_off[:, 0]
        return taken[start + t.plane_slabs.sum(axis=1)] - taken[start]

    @property
    def widths(self) -> np.ndarray:
        """Widths in use: what the kernels read now (the page table's, not the plan's)."""
        return self.table.width

    def request(self, widths: np.ndarray) -> None:
        """The planner's widths, lowered (widest blocks first) until they fit the slab pool;
        they take effect at the next commit."""
        self.pager.request(self.fit(np.asarray(widths, dtype=np.int64)))

    def fit(self, widths: np.ndarray) -> np.ndarray:
        """`widths` lowered until their slabs fit the pool: the blocks at the highest width
        give one bit each, those that free the most slabs first, one level at a time."""
        t, out = self.table, widths.copy()
        rows = np.arange(t.n_blocks)
        room = t.n_slabs - int(self.pager.lent.sum())  # slabs the KV cache holds are not theirs
        over = int(t.cost_at[rows, out].sum()) - room * t.slab_bytes
        for level in range(t.max_bits, t.min_bits, -1):
            if over <= 0:
                break
            at = np.flatnonzero(out == level)
            saved = t.cost_at[at, level] - t.cost_at[at, level - 1]
            order = np.argsort(-saved, kind="stable")
            take = np.searchsorted(np.cumsum(saved[order]), over) + 1
            chosen = at[order[:take]]
            out[chosen] -= 1
            over -= int(saved[order[:take]].sum())
        if over > 0:
            raise ValueError("the slab pool holds less than every block at its minimum width")
        return out

    def commit(self) -> int:
        """The step boundary: the pager commits, the device table follows. Copies the backend
        already finished (the CPU backend copies at submit) are confirmed at once, so a
        synchronous backend serves the requested widths from the next step on. Returns the
        bytes this boundary started copying (metrics)."""
        c = self.pager.commit()
        moved = self._copied_bytes(c)
        if c.submitted:
            self.pager.commit()
        self.dt.sync()
        self.moved_bytes += moved
        return moved

    def settle(self) -> None:
        """Commit and wait until every block runs at its requested width (start-up, policy
        switches outside the serving loop)."""
        self.pager.settle()
        self.dt.sync()

    def device_bytes(self) -> int:
        """Device bytes this backend holds: its slab pool."""
        t = self.table
        return t.n_slabs * t.slab_bytes

    def _copied_bytes(self, c: Commit) -> int:
        """Bytes of the copies a commit submitted: the in-flight planes of the blocks it
        started promoting (a promotion's planes are in flight until a later commit)."""
        t = self.table
        if not c.submitted:
            return 0
        b = np.asarray(c.submitted)
        return int((t.plane_slabs[b] * (t.state[b] == IN_FLIGHT)).sum()) * t.slab_bytes
