"""One memory budget for the whole runtime: expert planes + KV blocks + a fixed part (non-expert
weights and the activation workspace).

    total = fixed + planes + kv_limit * block_bytes

Fixed policies (fp16, uniform:B, static:BUDGET, pagedweight-paging) hold their plane bytes; the KV
cache gets the rest. Dynamic ones hold between BUDGET (at peak KV pressure) and the widest widths:
when the scheduler needs blocks beyond the limit, `make_room` asks the planner to free plane
bytes (down to BUDGET and the planner's bit floors); after each step `rebalance` gives plane bytes
the KV cache does not need back to the planner, which promotes with its own hysteresis. Widths
change only here, between steps. Counts and bytes of both directions are kept for metrics.

On the paged backend (`paged`) planes and KV blocks share one arena of slabs, sized `total -
fixed` once at start-up: planes count in whole slabs (PageTable.cost_at), and per block the
larger of the plan and what it holds now (in flight, retiring), so the KV limit never counts
bytes a demotion has not freed yet; `make_room` makes its demotions real at once (commit, wait
for the fences, reclaim), and the KV cache then takes the freed slabs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pwctl.errors import PwctlError
from pwctl.runtime.memory.expert_store import ExpertStore
from pwctl.runtime.memory.kv_cache import KVCache
from pwctl.runtime.widths.allocator import WidthAllocator

if TYPE_CHECKING:
    from pwctl.runtime.memory.paged_experts import PagedExperts


@dataclass(frozen=True)
class PromotionRule:
    """When plane memory the KV cache left free goes back to the planes (demotions stay on
    demand and immediate): only once the spare bytes stay above `watermark` x the arena for
    `hold` steps in a row (a free-memory signal wavering around the mark moves widths at most
    once a crossing), and at most `cap` x the arena a step (the pager's copies spread over
    steps; the KV cache can take bytes back at once either way). A demotion frees `headroom` x
    the arena beyond the blocks asked for, so a KV cache growing a block or two a step demotes
    once every many steps, not every step (each demotion waits for the device: bursty load,
    H100, 2026-12-06, 258 moves per 1,000 tokens); below the watermark, so what it leaves spare
    is not promoted back."""

    watermark: float = 0.02
    hold: int = 4
    cap: float = 0.125
    headroom: float = 0.01

    def __post_init__(self) -> None:
        if not 0 <= self.headroom < self.watermark:
            raise ValueError("headroom must be below the watermark (else it is promoted back)")


@dataclass
class WidthMoves:
    """Width changes made for the KV cache (each counts blocks whose width moved)."""

    demotions: int = 0
    demoted_bytes: int = 0
    promotions: int = 0
    promoted_bytes: int = 0


class MemoryBudget:
    def __init__(
        self,
        total: int,
        fixed: int,
        store: ExpertStore,
        kv: KVCache,
        allocator: WidthAllocator | None = None,
        on_widths: Callable[[np.ndarray], None] | None = None,
        paged: PagedExperts | None = None,
        promotion: PromotionRule | None = None,
    ):
        """Changes `store.widths` in place (`on_widths` is called after each change: the GPU
        path hands them to the pager). `allocator`: the policy's, if it is budgeted. `paged`:
        the paged backend whose arena holds planes and `kv`'s blocks."""
        self.total, self.fixed, self.store, self.kv = int(total), int(fixed), store, kv
        self.paged = paged
        # bytes planes and KV blocks share: the arena's whole slabs on the paged backend
        self.space = self.total - self.fixed
        if paged is not None:
            self.space = paged.table.n_slabs * paged.table.slab_bytes
        self.widths = store.widths
        self._layer = np.array([b.layer for b in store.pack.blocks])  # MoE layer of each block
        self._held = store.pack.held  # the widths reported are the held blocks' (Pack.held)
        self.allocator = allocator if allocator is not None and allocator.dynamic else None
        self.on_widths = on_widths
        self.moves = WidthMoves()
        self.promotion = promotion or PromotionRule()
        self._spare_steps = 0  # steps in a row the spare bytes stayed above the watermark
        self.planes = self._plane_bytes()
        if self.allocator is not None:
            self._set(self.allocator.replan(self.space))
        self._update_limit()

    @staticmethod
    def kv_capacity(total: int, fixed: int, floor: int, block_bytes: int) -> int:
        """The most KV blocks the budget can ever give (planes at their floor)."""
        return max(0, (int(total) - int(fixed) - int(floor)) // block_bytes)

    @property
    def kv_bytes(self) -> int:
        return self.kv.pool.limit * self.kv.block_bytes

    def make_room(self, n_blocks: int, urgent: bool = False) -> bool:
        """Raise the KV limit by `n_blocks` by demoting planes; whether it now fits. Within
        BUDGET and the planner's floors; when `urgent` (else a running sequence would be
        preempted, or a request could never start) and those cannot free enough, they give
        way, down to the narrowest widths. A new request that is not urgent waits instead."""
        if self.allocator is None or n_blocks <= 0:
            return n_blocks <= 0
        want = self.kv.pool.limit + n_blocks
        target = self.space - want * self.kv.block_bytes
        headroom = int(self.promotion.headroom * self.space) // self.kv.block_bytes
        self._set(self.allocator.fit(target - headroom * self.kv.block_bytes))
        if urgent and self.planes > target and not self.allocator.relaxed:
            self._set(self.allocator.squeeze(target))  # floors give way for what is asked only
        if self.paged is not None:
            self.paged.reclaim()  # the demoted planes' slabs are free now
        self._update_limit()
        return self.kv.available >= n_blocks

    def rebalance(self, kv_wanted: int) -> None:
        """After a step: planes may take what `kv_wanted` blocks (those in use plus what the
        queue and the next decodes need) leave free, as `promotion` allows; promotes only
        (demotion is on demand). A plan that would not fit the spare bytes (floors coming back
        after a squeeze) is not taken: the planner keeps the widths in use."""
        if self.allocator is None:
            return
        spare = self.space - kv_wanted * self.kv.block_bytes
        self.allocator.unsqueeze(spare)
        rule = self.promotion
        above = spare - self.planes > rule.watermark * self.space
        self._spare_steps = self._spare_steps + 1 if above else 0
        if self._spare_steps < rule.hold or self._at_widest():
            return
        target = min(spare, self.planes + int(rule.cap * self.space))
        new = self.allocator.fit(target)
        if self.allocator.planner.bytes() > spare:  # the plan's bytes, as `_plane_bytes` counts
            self.allocator.adopt(self.widths)
            return
        if np.array_equal(new, self.widths):
            # nothing promoted (the planner's hysteresis): the next try waits `hold` steps, so
            # memory to spare does not cost a plan every step
            self._spare_steps = 0
        self._set(new)
        self._update_limit()

    def _at_widest(self) -> bool:
        """Every block at the widest width a plan gives: there is nothing to promote. With
        memory to spare at the cap (`--max-bits 4`, no pressure), a plan a step was host work
        beside each step: on an H100 (2026-12-06) pagedweight's batch-1 step took 3.6 ms
        against uniform:4's 2.3-2.8 at the same widths."""
        assert self.allocator is not None  # rebalance returns first without one
        return bool((self.widths >= self.allocator.widest).all())

    def widths_per_layer(self) -> dict[int, float]:
        """Mean width (bits) of each MoE layer's blocks."""
        layer, widths = self._layer[self._held], self.widths[self._held]
        return {int(li): float(widths[layer == li].mean()) for li in np.unique(layer)}

    def _set(self, new: np.ndarray) -> None:
        new = np.asarray(new, dtype=self.widths.dtype)
        down, up = new < self.widths, new > self.widths
        if not (down.any() or up.any()):
            return
        before = self.planes
        self.moves.demotions += int(down.sum())
        self.moves.promotions += int(up.sum())
        self.store.plan.set(new)
        self.planes = self._plane_bytes()
        freed = self._moved_bytes(down, up, before)
        self.moves.demoted_bytes += freed[0]
        self.moves.promoted_bytes += freed[1]
        if self.on_widths is not None:
            self.on_widths(self.widths)

    def _moved_bytes(self, down: np.ndarray, up: np.ndarray, before: int) -> tuple[int, int]:
        delta = self.planes - before
        if down.any() and up.any():  # both in one plan: split by the blocks that moved
            return max(0, -delta), max(0, delta)
        return (-delta, 0) if down.any() else (0, delta)

    def _plane_bytes(self) -> int:
        """Bytes of the planes at the planned widths (whole slabs on the paged backend)."""
        if self.paged is None:
            return self.store.expert_bytes()
        return self.paged.plane_cost(self.widths)

    def _update_limit(self) -> None:
        planes = self.planes
        if self.paged is not None:  # slabs still held above the plan are not free yet
            planes = self.paged.committed_bytes(self.widths)
        limit = (self.space - planes) // self.kv.block_bytes
        if limit < 0:
            raise PwctlError(
                f"the memory budget ({self.total / 1e6:.2f} MB) is below what the experts "
                f"({self.planes / 1e6:.2f} MB) and the rest of the model ({self.fixed / 1e6:.2f}"
                " MB) take: raise --memory-budget or pick a smaller policy"
            )
        self.kv.pool.set_limit(limit)
