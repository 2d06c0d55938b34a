"""The paged execution backend of the experts: one page table, a slab arena (CudaBackend on
CUDA, CpuBackend's host arena on the CPU), the pager that moves planes, the device mirror of
widths and slab map, and the fused MoE that reads them (docs/RUNTIME.md).

The engine hands it the planner's widths (`request`) whenever they change and calls `commit`
at every step boundary; `MoEBlock` calls `__call__` for the experts of its layer. The widths the
kernels read (`widths`) lag the requested ones while promotions copy."""

from __future__ import annotations

import numpy as np
import torch

from pwctl.pack import Pack
from pwctl.recipe import MoESpec
from pwctl.runtime.device_table import DeviceTable
from pwctl.runtime.fused_moe import FusedMoE
from pwctl.runtime.page_table import IN_FLIGHT, PageTable
from pwctl.runtime.pager import Commit, CpuBackend, CudaBackend, Pager


class PagedExperts:
    def __init__(self, pack: Pack, device: str = "cpu", budget_bytes: int | None = None):
        """`budget_bytes`: the slab pool; default: every block at its widest width (in whole
        slabs), so any plan fits and no promotion ever waits for slabs."""
        probe = PageTable.from_pack(pack, 0)  # the slab size and per-width costs only
        if budget_bytes is None:
            budget_bytes = int(probe.cost_at[:, probe.max_bits].sum())
        self.table = PageTable.from_pack(pack, budget_bytes, probe.slab_bytes)
        if device.startswith("cuda"):
            self.backend: CpuBackend | CudaBackend = CudaBackend.from_pack(
                pack, self.table, device=device
            )
            arena = self.backend.slabs
        else:
            self.backend = CpuBackend.from_pack(pack, self.table)
            arena = torch.from_numpy(self.backend.arena)
        self.pager = Pager(self.table, self.backend)
        self.dt = DeviceTable(self.table, arena, pack.blocks)
        self.fused = FusedMoE(MoESpec(**pack.manifest.spec), self.dt, pack.index)
        self.moved_bytes = 0  # host -> device bytes of every promotion submitted so far

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
        over = int(t.cost_at[rows, out].sum()) - t.n_slabs * t.slab_bytes
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
        """Device bytes this backend holds: the slab pool plus the CUDA staging buffer."""
        t = self.table
        return t.n_slabs * t.slab_bytes + getattr(self.backend, "workspace_bytes", 0)

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        index: torch.Tensor,
        shared_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The experts of `layer` for tokens x [T, H]: float32 [T, H]."""
        return self.fused(layer, x, weights, index, shared_scale)

    def _copied_bytes(self, c: Commit) -> int:
        """Bytes of the copies a commit submitted: the in-flight planes of the blocks it
        started promoting (a promotion's planes are in flight until a later commit)."""
        t = self.table
        if not c.submitted:
            return 0
        b = np.asarray(c.submitted)
        return int((t.plane_slabs[b] * (t.state[b] == IN_FLIGHT)).sum()) * t.slab_bytes
