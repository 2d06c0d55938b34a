"""The planned width of every block, with one writer.

Widths are one int per block (bits; FP16_WIDTH for the reference weights, a registered
variant's code for a baseline such as RTN). Everything reads them through `WidthPlan.widths`, a
read-only view (numpy refuses any write through it), and every change goes through `set`: the
fixed policies (`ExpertStore.apply`, `limit`), the budgeted policies' first plan
(`Engine.set_policy`), the memory budget's moves between steps (`MemoryBudget`), and the
profile's per-block sweeps. The paged backend's own widths (what kernels read, lagging the plan
while promotions copy) are the pager's, not these."""

from __future__ import annotations

import numpy as np


class WidthPlan:
    def __init__(self, n_blocks: int, width: int):
        self._widths = np.full(n_blocks, width, dtype=np.int64)
        self._view = self._widths.view()
        self._view.flags.writeable = False

    @property
    def widths(self) -> np.ndarray:
        """Every block's planned width: a read-only view that follows `set`."""
        return self._view

    def set(self, widths: np.ndarray | int, blocks: np.ndarray | int | slice = slice(None)) -> None:
        """Plan `widths` for `blocks` (default: every block)."""
        self._widths[blocks] = widths
