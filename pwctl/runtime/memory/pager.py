"""The pager: moves planes between pinned host memory and a byte-budgeted pool of device slabs,
committing width changes only at step boundaries (docs/RUNTIME.md has the state machine).

Demotion lowers the width in use first, then reclaims the dropped planes once a fence says every
kernel launched before the change finished. Promotion copies all missing planes, confirms their
arrival, then raises the width in use. A failed or cancelled copy leaves the block at its old
width and returns its slabs (a cancelled copy's slabs only once it has stopped writing).

The pool is shared: the KV cache borrows slabs (`lend`) and returns them behind a fence
(`give_back`), so the bytes a demotion frees become KV blocks and back (docs/RUNTIME.md).

The device is a small backend: `CpuBackend` (CPU mode and tests: a host arena stands for GPU
memory) or `CudaBackend` (one device arena, its own copy stream, CUDA events as fences).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pwctl.format.pack import Pack
from pwctl.runtime.memory.page_table import GPU, HOST, IN_FLIGHT, NO_FENCE, PageTable

if TYPE_CHECKING:
    import torch

PENDING, DONE, FAILED = 0, 1, 2  # copy status


@dataclass(frozen=True)
class Copy:
    """Host bytes [host_offset, host_offset + len(slab_ids) * slab) into slabs, in order."""

    host_offset: int
    slab_ids: np.ndarray


class Backend(Protocol):
    slab_bytes: int

    def submit(self, copies: list[Copy]) -> list[int]:
        """Enqueue copies; one ticket each. They run beside kernels, in order."""

    def poll(self, ticket: int) -> int:
        """PENDING, DONE (data arrived) or FAILED (stopped; it writes nothing more)."""

    def fence(self) -> int:
        """A fence after every kernel launched so far."""

    def fence_done(self, fence: int) -> bool: ...

    def read(self, slab_ids: np.ndarray, nbytes: int) -> np.ndarray:
        """The first nbytes held by these slabs (tests and debugging; synchronizes)."""

    def sync(self) -> None:
        """Wait for every copy and kernel."""


def load_host(pack: Pack, table: PageTable, out: np.ndarray) -> np.ndarray:
    """Fill `out` (uint8 [table.host_bytes]) with every plane in the slab-padded host layout,
    checking each plane's CRC once; the pager never reads the pack again."""
    for b, block in enumerate(pack.blocks):
        for p in range(table.max_bits):
            bits, tab = pack.read_plane(block, p)
            start, _ = table.host_range(b, p, p + 1)
            raw = bits.view(np.uint8).ravel()
            out[start : start + raw.size] = raw
            if tab is not None:
                t = tab.view(np.uint8).ravel()
                out[start + raw.size : start + raw.size + t.size] = t
    return out


class CpuBackend:
    """CPU mode: `arena` [n_slabs, slab_bytes] stands for GPU memory and copies are memcpy.
    With deferred=True copies land only at `complete` and kernels (`launch`) stay pending until
    `finish`, so tests interleave them with commits; fences count kernels."""

    def __init__(self, host: np.ndarray, n_slabs: int, slab_bytes: int, deferred: bool = False):
        self.host, self.slab_bytes, self.deferred = host, slab_bytes, deferred
        self.arena = np.zeros((n_slabs, slab_bytes), dtype=np.uint8)
        self.status: list[int] = []
        self._copies: dict[int, Copy] = {}
        self.launched = self.finished = 0
        self._fences: list[int] = []

    @classmethod
    def from_pack(cls, pack: Pack, table: PageTable, deferred: bool = False) -> CpuBackend:
        host = load_host(pack, table, np.zeros(table.host_bytes, dtype=np.uint8))
        return cls(host, table.n_slabs, table.slab_bytes, deferred)

    def submit(self, copies: list[Copy]) -> list[int]:
        tickets = list(range(len(self.status), len(self.status) + len(copies)))
        self.status += [PENDING] * len(copies)
        self._copies.update(zip(tickets, copies, strict=True))
        if not self.deferred:
            self.complete()
        return tickets

    def poll(self, ticket: int) -> int:
        return self.status[ticket]

    def complete(self, ticket: int | None = None) -> None:
        """Land one pending copy (or all of them)."""
        for t in list(self._copies) if ticket is None else [ticket]:
            c = self._copies.pop(t, None)
            if c is not None:
                n = c.slab_ids.size * self.slab_bytes
                src = self.host[c.host_offset : c.host_offset + n]
                self.arena[c.slab_ids] = src.reshape(-1, self.slab_bytes)
                self.status[t] = DONE

    def fail(self, ticket: int) -> None:
        """A copy that dies half-way: its first slabs hold garbage, then it stops."""
        c = self._copies.pop(ticket, None)
        if c is not None:
            self.arena[c.slab_ids[: (c.slab_ids.size + 1) // 2]] = 0xA5
            self.status[ticket] = FAILED

    def pending(self) -> list[int]:
        return list(self._copies)

    def launch(self) -> int:
        """A kernel launched on the compute stream; returns its sequence number."""
        self.launched += 1
        if not self.deferred:
            self.finished = self.launched
        return self.launched

    def finish(self, upto: int | None = None) -> None:
        """Kernels finish in launch order (one stream): all of them, or those up to `upto`."""
        self.finished = self.launched if upto is None else max(self.finished, upto)

    def fence(self) -> int:
        self._fences.append(self.launched)
        return len(self._fences) - 1

    def fence_done(self, fence: int) -> bool:
        return self.finished >= self._fences[fence]

    def read(self, slab_ids: np.ndarray, nbytes: int) -> np.ndarray:
        return self.arena[slab_ids].ravel()[:nbytes].copy()

    def sync(self) -> None:
        self.complete()
        self.finish()


def copy_runs(copies: list[Copy], slab_bytes: int) -> list[tuple[int, int, int]]:
    """(host offset, first slab, slabs) of each run of adjacent host bytes going to adjacent
    slabs, in order: one device copy each. A copy's host bytes are contiguous, and the pool
    hands out low ids first, so a block's planes, and consecutive blocks, are mostly one run."""
    copies = [c for c in copies if c.slab_ids.size]
    if not copies:
        return []
    dst = np.concatenate([c.slab_ids for c in copies]).astype(np.int64)
    src = np.concatenate(
        [c.host_offset + slab_bytes * np.arange(c.slab_ids.size, dtype=np.int64) for c in copies]
    )
    breaks = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != slab_bytes)) + 1
    starts, stops = np.r_[0, breaks], np.r_[breaks, dst.size]
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts, stops, strict=True)]


class CudaBackend:
    """Pinned host planes (read once from the pack), one preallocated device arena split into
    slabs, its own copy stream; CUDA events are the fences. A submit copies each run of adjacent
    host bytes bound for adjacent slabs straight into them (`copy_runs`): the copy engine moves
    the bytes, no kernel on the SMs does (a staging buffer and an `index_copy_` scatter did, and
    decode steps beside a promotion ran 16-20% slower: issue 60). Slabs handed to a copy are
    free (their old readers' fences passed), so the copy stream never waits on compute, and a
    promotion is read only after its event completed."""

    def __init__(self, host: torch.Tensor, n_slabs: int, slab_bytes: int, device: str = "cuda"):
        import torch

        if not host.is_pinned():
            raise ValueError("CudaBackend needs pinned host planes (see from_pack)")
        self.torch, self.host, self.slab_bytes = torch, host, slab_bytes
        self.device = torch.device(device)
        self.slabs = torch.empty((n_slabs, slab_bytes), dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(self.device)
        self._events: dict[int, torch.cuda.Event] = {}  # tickets and fences, popped when done
        self._next = 0

    @classmethod
    def from_pack(cls, pack: Pack, table: PageTable, **kw) -> CudaBackend:
        import torch

        host = torch.empty(table.host_bytes, dtype=torch.uint8, pin_memory=True)
        load_host(pack, table, host.numpy())
        return cls(host, table.n_slabs, table.slab_bytes, **kw)

    def _ids(self, n: int) -> list[int]:
        ids = list(range(self._next, self._next + n))
        self._next += n
        return ids

    def submit(self, copies: list[Copy]) -> list[int]:
        if not copies:
            return []
        torch, S = self.torch, self.slab_bytes
        with torch.cuda.stream(self.stream):
            for src, dst, m in copy_runs(copies, S):
                self.slabs[dst : dst + m].view(-1).copy_(
                    self.host[src : src + m * S], non_blocking=True
                )
            event = torch.cuda.Event()
            event.record(self.stream)
        tickets = self._ids(len(copies))
        self._events.update(dict.fromkeys(tickets, event))
        return tickets

    def poll(self, ticket: int) -> int:
        event = self._events.get(ticket)
        if event is None or event.query():
            self._events.pop(ticket, None)
            return DONE
        return PENDING

    def fence(self) -> int:
        event = self.torch.cuda.Event()
        event.record(self.torch.cuda.current_stream(self.device))
        (fid,) = self._ids(1)
        self._events[fid] = event
        return fid

    def fence_done(self, fence: int) -> bool:
        return self.poll(fence) == DONE

    def read(self, slab_ids: np.ndarray, nbytes: int) -> np.ndarray:
        self.sync()
        idx = self.torch.as_tensor(slab_ids.astype(np.int64), device=self.device)
        return self.slabs[idx].reshape(-1)[:nbytes].cpu().numpy()

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)


class SlabPool:
    """Fixed-size slabs on a LIFO free stack: take / give are O(k) numpy slices, no device
    allocation ever; lowest ids come out first, so fresh pools hand out contiguous runs."""

    def __init__(self, n_slabs: int):
        self._stack = np.arange(n_slabs - 1, -1, -1, dtype=np.int32)
        self.top = n_slabs

    def take(self, k: int) -> np.ndarray | None:
        if k > self.top:
            return None
        self.top -= k
        return self._stack[self.top : self.top + k][::-1].copy()

    def give(self, ids: np.ndarray) -> None:
        self._stack[self.top : self.top + ids.size] = ids[::-1]
        self.top += ids.size

    @property
    def free_ids(self) -> np.ndarray:
        return self._stack[: self.top]


@dataclass
class Commit:
    """What one step boundary did (metrics and logs)."""

    raised: list[int] = field(default_factory=list)  # width in use went up
    lowered: list[int] = field(default_factory=list)  # width in use went down
    submitted: list[int] = field(default_factory=list)  # promotions whose copies started
    failed: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # promotions without free slabs yet
    reclaimed_bytes: int = 0


class Pager:
    def __init__(self, table: PageTable, backend: Backend):
        if backend.slab_bytes != table.slab_bytes:
            raise ValueError("backend and page table disagree on the slab size")
        self.table, self.backend = table, backend
        self.pool = SlabPool(table.n_slabs)
        self._retiring: deque[tuple[int, int, int, int]] = deque()  # fence, block, lo, hi
        self._held: list[tuple[int, np.ndarray]] = []  # cancelled copies' ticket, slabs
        # slabs lent to another owner (the KV cache) out of the same pool, and those it gave
        # back that kernels launched before the give-back may still read (fence, ids)
        self.lent = np.zeros(table.n_slabs, dtype=bool)
        self._returning: deque[tuple[int, np.ndarray]] = deque()
        self._order: np.ndarray | None = None
        self._fence: int | None = None  # this commit's fence, recorded on first use

    def request(self, wanted: np.ndarray, order: np.ndarray | None = None) -> None:
        """Set the wanted width of every block (e.g. Plan.widths); `order`: block ids to
        promote first (most valuable first); takes effect at the next commit."""
        t = self.table
        w = np.asarray(wanted)
        ok = (w == 0) | ((w >= t.min_bits) & (w <= t.max_bits))
        if w.shape != (t.n_blocks,) or not ok.all():
            raise ValueError(f"wanted widths must be 0 or {t.min_bits}..{t.max_bits} per block")
        t.wanted[:] = w
        self._order = None if order is None else np.asarray(order, dtype=np.int64)

    def commit(self, promote: bool = True) -> Commit:
        """The step boundary: call between decode steps, never while one is being launched.
        `promote=False`: confirm arrivals and demote only (no slab taken, no copy started),
        e.g. to free slabs for the KV cache in the middle of scheduling."""
        c = Commit()
        self._fence = None
        self._reclaim(c)
        self._arrive(c)
        self._lower(c)
        self._reclaim(c)  # fences of kernels that already finished free slabs at once
        if promote:
            self._raise(c)
        return c

    # --- slabs lent out of the pool (the KV cache shares it with the planes) ------------------

    def lend(self, n: int) -> np.ndarray | None:
        """`n` free slabs for another owner, or None (nothing taken). Only reclaimed slabs are
        free: slabs still retiring (read by kernels before their fence) never come out."""
        self._reclaim(Commit())
        ids = self.pool.take(n)
        if ids is not None:
            self.lent[ids] = True
        return ids

    def give_back(self, ids: np.ndarray) -> None:
        """Lent slabs back: to the pool once every kernel launched so far has finished (one
        fence recorded now: they may still be read, and a copy must not overwrite them)."""
        ids = np.asarray(ids, dtype=np.int32)
        if ids.size == 0:
            return
        if not self.lent[ids].all():
            raise ValueError("giving back slabs that were not lent")
        self.lent[ids] = False
        self._returning.append((self.backend.fence(), ids.copy()))

    def drain(self) -> None:
        """Wait for every kernel and copy, then reclaim whatever they held (retiring planes,
        stopped copies, slabs given back): bytes freed by demotion really are free after it.
        Waits only if something is waiting to be reclaimed."""
        self._reclaim(Commit())
        if self._retiring or self._held or self._returning:
            self.backend.sync()
            self._reclaim(Commit())

    def cancelled_slabs(self) -> int:
        """Slabs of cancelled copies that may still be writing (reclaimed once they stop)."""
        return sum(ids.size for _, ids in self._held)

    def counts(self) -> dict[str, int]:
        """Slabs by holder: planes (resident, in flight, retiring, cancelled copies still
        writing), lent (KV blocks, including those given back and not yet reclaimed), free.
        They always add up to the pool."""
        t = self.table
        planes = int((t.slab_map >= 0).sum()) + self.cancelled_slabs()
        lent = int(self.lent.sum()) + sum(ids.size for _, ids in self._returning)
        return {"planes": planes, "lent": lent, "free": int(self.pool.top), "all": t.n_slabs}

    def settle(self, max_commits: int = 1000) -> int:
        """Commit and wait until every block sits at its wanted width (start-up, tests)."""
        t = self.table
        for i in range(max_commits):
            self.commit()
            busy = (t.retire_at != NO_FENCE).any() or (t.target > 0).any() or self._held
            if not busy and (t.width == t.wanted).all():
                return i + 1
            self.backend.sync()
        raise RuntimeError("pager did not settle (wanted widths do not fit the slab pool?)")

    def check(self) -> None:
        held = [ids for _, ids in self._held] + [ids for _, ids in self._returning]
        held.append(np.flatnonzero(self.lent).astype(np.int32))
        self.table.check(self.pool.free_ids, np.concatenate(held))
        c = self.counts()
        assert c["planes"] + c["lent"] + c["free"] == c["all"], f"slabs do not add up: {c}"

    # --- the moves of a commit ----------------------------------------------------------------

    def _fence_now(self) -> int:
        if self._fence is None:
            self._fence = self.backend.fence()
        return self._fence

    def _retire(self, b: int, lo: int, hi: int) -> None:
        if lo < hi:
            f = self._fence_now()
            self.table.retire_at[b, lo:hi] = f
            self._retiring.append((f, b, lo, hi))

    def _reclaim(self, c: Commit) -> None:
        t = self.table
        # fences complete in order (one compute stream), so the queue drains from the front
        while self._retiring and self.backend.fence_done(self._retiring[0][0]):
            f, b, lo, hi = self._retiring.popleft()
            for p in range(lo, hi):
                if t.retire_at[b, p] == f:  # not taken back by a promotion meanwhile
                    ids = t.slabs(b, p, p + 1)
                    self.pool.give(ids.copy())
                    c.reclaimed_bytes += ids.size * t.slab_bytes
                    ids[:] = -1
                    t.state[b, p] = HOST
                    t.retire_at[b, p] = NO_FENCE
        keep = []
        for ticket, ids in self._held:
            if self.backend.poll(ticket) == PENDING:
                keep.append((ticket, ids))
            else:
                self.pool.give(ids)
                c.reclaimed_bytes += ids.size * t.slab_bytes
        self._held = keep
        while self._returning and self.backend.fence_done(self._returning[0][0]):
            _, ids = self._returning.popleft()
            self.pool.give(ids)

    def _drop_flight(self, b: int, stopped: bool) -> None:
        """Undo block b's promotion: its in-flight planes go back to HOST (slabs returned now
        if the copy stopped, else held until it does); planes it took back from retirement are
        retired again behind a fresh fence. The width in use is untouched."""
        t = self.table
        w, k = int(t.width[b]), int(t.target[b])
        first = w + int((t.state[b, w:k] == GPU).sum())
        if first < k:
            ids = t.slabs(b, first, k)
            if stopped:
                self.pool.give(ids.copy())
            else:
                self._held.append((int(t.ticket[b]), ids.copy()))
            ids[:] = -1
            t.state[b, first:k] = HOST
        self._retire(b, w, first)
        t.target[b], t.ticket[b] = 0, -1

    def _arrive(self, c: Commit) -> None:
        t = self.table
        for b in np.flatnonzero(t.target > 0):
            status = self.backend.poll(int(t.ticket[b]))
            if status == DONE:  # arrival confirmed: only now may kernels read the planes
                t.state[b, t.width[b] : t.target[b]] = GPU
                t.width[b], t.target[b], t.ticket[b] = t.target[b], 0, -1
                c.raised.append(int(b))
            elif status == FAILED:
                self._drop_flight(int(b), stopped=True)
                t.wanted[b] = t.width[b]  # the planner sees the block stayed where it was
                c.failed.append(int(b))

    def _lower(self, c: Commit) -> None:
        t = self.table
        flying = t.target > 0
        for b in np.flatnonzero((flying & (t.wanted < t.target)) | (t.wanted < t.width)):
            if t.target[b] > 0:
                self._drop_flight(int(b), stopped=False)
                c.cancelled.append(int(b))
            w, new = int(t.width[b]), int(t.wanted[b])
            if new < w:
                t.width[b] = new  # kernels launched from now on read only `new` planes
                self._retire(int(b), new, w)
                c.lowered.append(int(b))

    def _raise(self, c: Commit) -> None:
        t = self.table
        todo = (t.wanted > t.width) & (t.target == 0)
        if self._order is not None:
            first = self._order[todo[self._order]]
            rest = np.setdiff1d(np.flatnonzero(todo), first, assume_unique=True)
            blocks = np.concatenate([first, rest])
        else:
            blocks = np.flatnonzero(todo)
        copies, started = [], []
        for b in blocks:
            w, hi = int(t.width[b]), int(t.wanted[b])
            k = min(hi, w + int((t.state[b, w:hi] == GPU).sum()))  # planes still on the GPU
            if k < hi:
                ids = self.pool.take(
                    int(t.slab_off[b, hi - 1] + t.plane_slabs[b, hi - 1] - t.slab_off[b, k])
                )
                if ids is None:
                    c.waiting.append(int(b))
                    continue
                t.slabs(b, k, hi)[:] = ids
                t.state[b, k:hi] = IN_FLIGHT
                copies.append(Copy(t.host_range(b, k, hi)[0], ids))
                started.append(int(b))
            t.retire_at[b, w:k] = NO_FENCE  # still resident: take them back, no copy needed
            if k == hi:
                t.width[b] = hi
                c.raised.append(int(b))
            else:
                t.target[b] = hi
        for b, ticket in zip(started, self.backend.submit(copies), strict=True):
            t.ticket[b] = ticket
        c.submitted += started
