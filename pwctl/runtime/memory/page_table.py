"""The page table: one entry per block (the pack's `blocks` order), struct-of-arrays in numpy.

Per block: width in use (what kernels read), width wanted (what the planner asked for), the width
an in-flight promotion will reach, last use (metrics and tie-breaks only: nothing is evicted by
recency). Per plane: residency (HOST / IN_FLIGHT / GPU), the fence after which a dropped plane is
reclaimed, and its slab ids. Every plane lives in host memory; a GPU copy occupies
ceil(nbytes / slab_bytes) slabs of the pager's pool, recorded in `slab_map[slab_off[b, p]:...]`.
Host planes use the same layout padded to whole slabs, so a block's planes lo..hi are one
contiguous host range and one copy. Widths are bit counts: 0 (nothing resident, only before the
first load) or min_bits..max_bits. The pager is the only writer; `check` states the invariants.
"""

from __future__ import annotations

import numpy as np

from pwctl.format.bitplanes import group_bytes
from pwctl.format.pack import ALIGN, BlockInfo, Pack

HOST, IN_FLIGHT, GPU = 0, 1, 2  # plane residency; HOST = only the pinned host copy
NO_FENCE = -1


def min_slab(blocks: list[BlockInfo]) -> int:
    """The least slab the kernels can read these blocks' planes from: a group of rows of the
    widest plane (bitplanes.group_bytes), so a row's words cross at most one slab edge
    (cuda/planes.cuh `row_ptr`)."""
    return max(group_bytes(b.words) for b in blocks)


def choose_slab(plane_bytes: np.ndarray, min_bytes: int = 0, waste: int = 16) -> int:
    """The largest power of two <= median plane / `waste` (>= the pack's 256-byte alignment):
    a plane wastes under one slab, so on average about 1 / (2 * waste) of its bytes. At least
    `min_bytes` (`min_slab`). Planes of no bytes (another rank's blocks: parallel/rank_pack.py)
    do not count, so a rank's slabs are those of the whole pack."""
    held = plane_bytes[plane_bytes > 0]
    median = float(np.median(held)) if held.size else ALIGN
    slab = max(ALIGN, 1 << int(np.log2(max(median / waste, 1))))
    return max(slab, 1 << max(min_bytes - 1, 0).bit_length())


class PageTable:
    def __init__(
        self,
        plane_bytes: np.ndarray,
        min_bits: int,
        budget_bytes: int,
        slab_bytes: int | None = None,
        layer: np.ndarray | None = None,
        expert: np.ndarray | None = None,
        shared: np.ndarray | None = None,
    ):
        """`plane_bytes` [n_blocks, max_bits]: plane p's bytes with the table it carries
        (PlaneInfo.nbytes). `budget_bytes`: device bytes the slab pool may hold."""
        pb = np.asarray(plane_bytes, dtype=np.int64)
        n, self.max_bits = pb.shape
        self.n_blocks, self.min_bits = n, min_bits
        self.slab_bytes = slab_bytes or choose_slab(pb)
        self.n_slabs = int(budget_bytes) // self.slab_bytes  # the pool never exceeds the budget
        self.budget_bytes = int(budget_bytes)
        self.plane_bytes = pb
        self.plane_slabs = -(-pb // self.slab_bytes)
        zero = np.zeros((n, 1), dtype=np.int64)
        # bytes_at[b, w] = BlockInfo.bytes_at(w); cost_at: the same in whole slabs (what the
        # budget and the planner count)
        self.bytes_at = np.concatenate([zero, np.cumsum(pb, axis=1)], axis=1)
        self.cost_at = np.concatenate([zero, np.cumsum(self.plane_slabs, axis=1)], axis=1)
        self.cost_at *= self.slab_bytes
        flat = self.plane_slabs.ravel()
        self.slab_off = (np.cumsum(flat) - flat).reshape(n, self.max_bits)
        self.slab_map = np.full(int(flat.sum()), -1, dtype=np.int32)
        self.host_bytes = int(flat.sum()) * self.slab_bytes
        self.width = np.zeros(n, dtype=np.int8)
        self.wanted = np.zeros(n, dtype=np.int8)
        self.target = np.zeros(n, dtype=np.int8)  # width an in-flight promotion reaches; 0 none
        self.ticket = np.full(n, -1, dtype=np.int64)  # its backend ticket
        self.state = np.zeros((n, self.max_bits), dtype=np.int8)
        self.retire_at = np.full((n, self.max_bits), NO_FENCE, dtype=np.int64)
        self.last_use = np.zeros(n, dtype=np.int64)
        self.layer = np.zeros(n, np.int64) if layer is None else np.asarray(layer, np.int64)
        self.expert = np.arange(n, dtype=np.int64) if expert is None else np.asarray(expert)
        self.shared = np.zeros(n, bool) if shared is None else np.asarray(shared, bool)

    def cost_of(self, widths: np.ndarray) -> np.ndarray:
        """Device bytes of each block at `widths` (bits), in whole slabs."""
        return self.cost_at[np.arange(self.n_blocks), np.asarray(widths, dtype=np.int64)]

    @classmethod
    def from_pack(cls, pack: Pack, budget_bytes: int, slab_bytes: int | None = None) -> PageTable:
        blocks = pack.blocks
        m = pack.manifest
        pb = np.array([[p.nbytes for p in b.planes] for b in blocks], dtype=np.int64)
        pb = pb.reshape(len(blocks), m.max_bits)
        if slab_bytes is None:
            slab_bytes = choose_slab(pb, min_slab(blocks))
        return cls(
            pb,
            m.min_bits,
            budget_bytes,
            slab_bytes,
            layer=np.array([b.layer for b in blocks]),
            expert=np.array([b.expert for b in blocks]),
            shared=np.array([b.shared for b in blocks]),
        )

    def slabs(self, block: int, lo: int, hi: int) -> np.ndarray:
        """View of the slab ids of planes lo..hi-1 of `block` (contiguous in slab_map)."""
        start = self.slab_off[block, lo]
        end = self.slab_off[block, hi - 1] + self.plane_slabs[block, hi - 1]
        return self.slab_map[start:end]

    def host_range(self, block: int, lo: int, hi: int) -> tuple[int, int]:
        """Byte range of planes lo..hi-1 of `block` in the slab-padded host layout."""
        start = int(self.slab_off[block, lo])
        end = int(self.slab_off[block, hi - 1] + self.plane_slabs[block, hi - 1])
        return start * self.slab_bytes, end * self.slab_bytes

    def leading_gpu(self) -> np.ndarray:
        """Per block, the number of leading planes resident on the GPU."""
        gpu = self.state == GPU
        return np.where(gpu.all(axis=1), self.max_bits, np.argmin(gpu, axis=1))

    def device_bytes(self) -> int:
        """Bytes of slabs held by planes (resident or in flight) on the device."""
        return int((self.slab_map >= 0).sum()) * self.slab_bytes

    def readable(self) -> np.ndarray:
        """[n_blocks, max_bits] planes a launched kernel may still read: those below the width
        in use and those dropped behind a fence that has not been reclaimed yet."""
        below = np.arange(self.max_bits)[None, :] < self.width[:, None]
        return below | (self.retire_at != NO_FENCE)

    def touch(self, blocks: np.ndarray, step: int) -> None:
        self.last_use[blocks] = step

    def check(self, free_slabs: np.ndarray | None = None, held: np.ndarray | None = None) -> None:
        """Assert the invariants. `free_slabs`: the pool's free ids; `held`: slabs the pager
        keeps outside the table (targets of cancelled copies that may still be writing)."""
        P, mn = self.max_bits, self.min_bits
        for name, w in (("width", self.width), ("wanted", self.wanted)):
            ok = (w == 0) | ((w >= mn) & (w <= P))
            assert ok.all(), f"{name} outside 0 or {mn}..{P}: {np.flatnonzero(~ok)[:8]}"
        # kernels read planes 0..width-1: they must all be on the GPU
        bad = self.width > self.leading_gpu()
        assert not bad.any(), f"width in use above resident planes: blocks {np.flatnonzero(bad)}"
        # per block: GPU planes, then in-flight ones, then host-only ones (one copy per promotion)
        order = (np.diff(self.state.astype(np.int16), axis=1) <= 0).all()
        assert order, "residency not GPU* IN_FLIGHT* HOST* along the planes"
        p = np.arange(P)[None, :]
        retiring = self.retire_at != NO_FENCE
        assert (self.state[retiring] == GPU).all(), "a retiring plane is not on the GPU"
        assert not (retiring & (p < self.width[:, None])).any(), "a plane in use is retiring"
        flying = self.target > 0
        assert (self.ticket[flying] >= 0).all(), "in-flight block without a ticket"
        assert (self.target[flying] > self.width[flying]).all(), "promotion not above width"
        inflight = self.state == IN_FLIGHT
        span = (p >= self.width[:, None]) & (p < self.target[:, None])
        assert not (inflight & ~span).any(), "plane in flight outside its block's promotion"
        # a GPU plane above the width is either retiring or reserved by a promotion in flight
        loose = (self.state == GPU) & (p >= self.width[:, None]) & ~retiring & ~span
        assert not loose.any(), f"orphan GPU planes in blocks {np.flatnonzero(loose.any(1))}"
        # slab ownership: GPU / in-flight planes own all their slabs, HOST planes none
        owned = np.repeat((self.state != HOST).ravel(), self.plane_slabs.ravel())
        ids = self.slab_map
        assert (ids[owned] >= 0).all(), "resident plane without slabs"
        assert (ids[~owned] == -1).all(), "host-only plane holds slabs"
        used = ids[owned]
        assert used.size == np.unique(used).size, "a slab is owned twice"
        assert (used < self.n_slabs).all(), "slab id outside the budgeted pool"
        held = np.zeros(0, np.int32) if held is None else held
        taken = np.concatenate([used, held])
        assert taken.size == np.unique(taken).size, "a held slab is also owned by a plane"
        assert taken.size * self.slab_bytes <= self.budget_bytes, "device bytes exceed the budget"
        if free_slabs is not None:
            assert np.unique(free_slabs).size == free_slabs.size, "a slab is free twice"
            assert not np.intersect1d(taken, free_slabs).size, "a slab in use is on the free list"
            assert taken.size + free_slabs.size == self.n_slabs, "slabs leaked or duplicated"
