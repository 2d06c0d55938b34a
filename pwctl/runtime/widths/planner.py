"""The planner: which blocks lose (or regain) planes, lowest expected damage per byte first.

Damage(block, width) = offline sensitivity x hot-expert factor (EMA of live router counts) x
prompt residual (per block and width, from the caller). Each block's damage curve is replaced by
its lower convex hull over (bytes, damage); `free` takes hull segments in increasing damage per
freed byte, `promote` in decreasing damage removed per added byte, with hysteresis. Greedy on
convex hulls is optimal for the fractional problem; for whole widths its damage exceeds the
optimum by at most the damage of the one segment the fractional optimum takes only in part
(docs/RUNTIME.md). Arrays are width-major [K, n_blocks] (K = max_bits - min_bits + 1), so every
operation is a handful of contiguous numpy passes; no Python loop runs over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from pwctl.errors import PwctlError
from pwctl.policy import Kind, Policy
from pwctl.runtime.memory.page_table import PageTable

MASK32 = np.uint64(0xFFFFFFFF)
FAR = np.float32(1e30)  # damage given to points outside a hull's width range
BIG = np.float32(1e38)  # slope bounds before any point is seen
TOL = np.float32(1e-5)  # relative: points this close to collinear are not hull vertices
NB = 0x7F9  # 12-bit buckets of non-negative float32 keys: 0 .. 0x7F8 (= inf)


@dataclass(frozen=True)
class PlannerConfig:
    use_router_stats: bool = True  # hot-expert factor and hot floor from live router counts
    use_residual: bool = True  # the caller's prompt-residual factor
    dynamic_paging: bool = True  # False: plan once at start, never change
    global_sensitivity: bool = True  # False: the same damage curve per byte for every block
    ema: float = 0.1  # weight of the newest router counts
    hot_share: float = 2.0  # routed >= hot_share x its layer's mean: hot
    hot_leave: float = 1.5  # ... and hot until routed < hot_leave x the mean (an expert near
    # hot_share would otherwise move its floor, and the hulls, back and forth every step)
    hot_cap: float = 8.0  # the hot factor is clipped to [1 / hot_cap, hot_cap]
    floor_bits: int | None = None  # lowest width of any block (None: min_bits)
    hot_floor: int = 1  # hot experts: at least floor + hot_floor bits
    shared_floor: int = 2  # shared experts (always hot): at least floor + shared_floor bits
    margin: float = 0.25  # while the last demotion is recent, a promotion must beat its rate so
    cooldown: int = 32  # steps a demoted block is not promoted (and the margin applies)

    @classmethod
    def from_policy(cls, policy: Policy, **kw) -> PlannerConfig:
        """pagedweight, or an ablation: the suffix names the signal switched OFF."""
        if policy.kind is not Kind.DYNAMIC:
            raise PwctlError(f"policy {policy.name} does not use the PagedWeight planner")
        off = {policy.switched_off: False} if policy.switched_off else {}
        return cls(**off, **kw)


@dataclass
class Plan:
    """One planning decision (metrics and logs). Widths are bits, one per block."""

    widths: np.ndarray  # int8 [n_blocks]: wanted widths after the plan
    order: np.ndarray  # blocks whose width changed, most valuable move first
    bytes_freed: int = 0
    bytes_added: int = 0
    damage: float = 0.0  # predicted damage of `widths`
    damage_delta: float = 0.0  # damage this plan added (< 0: removed)
    shortfall: int = 0  # bytes asked for that the floors (or frozen paging) did not allow
    rate: float = 0.0  # damage per byte of the last segment taken (the marginal rate)
    bound: float = 0.0  # whole widths are within this much damage of the fractional optimum


def uniform_damage(cost: np.ndarray) -> np.ndarray:
    """[K, n] damage without a sensitivity profile: every block the same curve per byte
    (quantization MSE falls 4x per bit), so greedy moves all blocks in step: uniform widths."""
    K = cost.shape[0]
    per_bit = 4.0 ** -np.arange(K, dtype=np.float64)
    return cost[-1][None, :] * (per_bit - per_bit[-1])[:, None]


class Planner:
    def __init__(
        self,
        cost: np.ndarray,
        damage: np.ndarray,
        min_bits: int,
        layer: np.ndarray | None = None,
        expert: np.ndarray | None = None,
        shared: np.ndarray | None = None,
        config: PlannerConfig | None = None,
    ):
        """`cost` [n, K]: device bytes of each block at widths min_bits..max_bits (e.g.
        PageTable.cost_at[:, min_bits:]); `damage` [n, K]: the offline sensitivity curve, taken
        relative to the widest width (damage there = 0), negatives clipped. Blocks start at the
        widest width; call `plan(budget)` first."""
        self.cfg = cfg = config or PlannerConfig()
        cost = np.asarray(cost, dtype=np.float64)
        n, K = cost.shape
        if np.shape(damage) != (n, K):
            raise ValueError(f"damage must be [n_blocks, {K}], got {np.shape(damage)}")
        if (np.diff(cost, axis=1) <= 0).any():
            raise ValueError("cost must grow with width")
        self.n, self.K, self.min_bits = n, K, min_bits
        self.c = np.ascontiguousarray(cost.T)  # exact bytes (float64 holds integers exactly)
        # the walks and the selection count bytes in units of their gcd (the slab): float32
        # then holds them exactly and halves the memory traffic (float64 if it cannot)
        ic = self.c.astype(np.int64)
        self.unit = int(np.gcd.reduce(ic.ravel())) if np.array_equal(ic, self.c) else 1
        cu = self.c / self.unit
        self._cu = np.ascontiguousarray(cu, np.float32 if cu.max() < 2**24 else np.float64)
        d = np.asarray(damage, dtype=np.float64).T
        d = np.clip(d - d[-1:], 0.0, None)
        d = d if cfg.global_sensitivity else uniform_damage(self.c)
        self.base = np.ascontiguousarray(d, dtype=np.float32)
        # 1 / (c[j] - c[i]) for every j > i, one [K-1-i, n] block per i
        self._inv = [(1.0 / (self.c[i + 1 :] - self.c[i])).astype(np.float32) for i in range(K)]
        self._min_step = float(np.diff(self._cu, axis=0).min()) if K > 1 else 1.0  # units
        self.shared = np.zeros(n, bool) if shared is None else np.asarray(shared, bool)
        layer = np.zeros(n, np.int64) if layer is None else np.asarray(layer)
        expert = np.arange(n) if expert is None else np.asarray(expert)
        self.layers, li = np.unique(layer, return_inverse=True)
        routed = ~self.shared
        self.n_experts = int(expert[routed].max()) + 1 if routed.any() else 1
        # each block's slot in the flattened [layers, experts] share table; shared experts
        # read an extra slot that always holds 1
        self._slot = np.where(
            routed, li * self.n_experts + expert, self.layers.size * self.n_experts
        )
        self.ema = np.ones((self.layers.size, self.n_experts))
        self.prior = np.ones((self.layers.size, self.n_experts))  # the profile's routing share
        self.hot = np.zeros((self.layers.size, self.n_experts), bool)  # per (layer, expert)
        if cfg.hot_leave > cfg.hot_share:
            raise ValueError("hot_leave above hot_share")
        self._observed = False  # has observe() seen live counts yet
        self._res_block: np.ndarray | None = None  # residual per block [n]
        self._res_width: np.ndarray | None = None  # residual per block and width [K, n]
        self._shape: np.ndarray | None = None  # base x residual per width, when there is one
        floor = 0 if cfg.floor_bits is None else cfg.floor_bits - min_bits
        if not 0 <= floor < K:
            raise ValueError(f"floor_bits outside {min_bits}..{min_bits + K - 1}")
        top = K - 1
        self._hot_floor = min(top, floor + cfg.hot_floor)
        self._base_floor = np.where(self.shared, min(top, floor + cfg.shared_floor), floor)
        self.k = np.full(n, K - 1, dtype=np.int64)  # wanted width - min_bits
        self.step = 0
        self.demoted_at = np.full(n, -(1 << 40), dtype=np.int64)
        self.last_rate, self.last_free = 0.0, -(1 << 40)
        self._planned = False
        self._ar = np.arange(n)
        self._kk = np.arange(K, dtype=np.int8)[:, None]
        flat = np.arange(K * n, dtype=np.uint64).reshape(K, n)
        self._tie_up = (flat, np.arange(K * n))  # ties: narrowest width first
        down = flat[::-1].ravel()  # ties: widest width first
        self._tie_down = (np.argsort(down).astype(np.uint64).reshape(K, n), down.astype(np.intp))
        self._dirty = True  # signals changed since the last _refresh
        self._hull_floors: np.ndarray | None = None  # floors the cached hulls were built for
        self._ws: dict = {}  # scratch arrays
        self._cache: dict[str, np.ndarray] = {}  # the hulls over floor..widest, and walks
        self._walked: set[str] = set()
        self.use_cache = True  # False: every decision builds its hulls afresh (tests)
        self.relaxed = False  # True: every floor is the narrowest width (see `relax`)

    @classmethod
    def from_table(
        cls, table: PageTable, damage: np.ndarray, config: PlannerConfig | None = None
    ) -> Planner:
        return cls(
            table.cost_at[:, table.min_bits :],
            damage,
            table.min_bits,
            table.layer,
            table.expert,
            table.shared,
            config,
        )

    # --- live signals -------------------------------------------------------------------------

    def tick(self) -> None:
        """One engine step passed (cooldowns count steps)."""
        self.step += 1

    def observe(self, counts: np.ndarray) -> None:
        """Router counts since the last call, [n_layers, n_experts] (layers in sorted order)."""
        counts = np.asarray(counts, dtype=np.float64)
        self._observed = True
        mean = counts.mean(axis=1, keepdims=True)
        live = mean[:, 0] > 0  # layers that saw no token keep their history
        a = self.cfg.ema
        self.ema[live] = (1 - a) * self.ema[live] + a * counts[live] / mean[live]
        self._update_hot()
        self._dirty = True

    def _update_hot(self) -> None:
        """Experts turn hot at hot_share x their layer's mean share, and cool below hot_leave."""
        s = self._layer_share()
        self.hot = (s >= self.cfg.hot_share) | (self.hot & (s >= self.cfg.hot_leave))

    def _layer_share(self) -> np.ndarray:
        """[layers, experts] each expert's EMA routing share over its layer's mean."""
        return self.ema / self.ema.mean(axis=1, keepdims=True)

    def relax(self, on: bool) -> None:
        """Floors off (`on`): every block may go to the narrowest width. The serving engine's
        last resort before a request would be cut short; back on once pressure falls."""
        if on != self.relaxed:
            self.relaxed = on
            self._dirty = True

    def set_prior(self, share: np.ndarray) -> None:
        """Routing share per (layer, expert) on the calibration text the sensitivity was
        measured on (Profile.router_share): offline damage already holds that average load, so
        the hot factor is the live share over this one."""
        share = np.asarray(share, dtype=np.float64)
        self.prior = np.maximum(share / share.mean(axis=1, keepdims=True), 1e-3)
        if not self._observed:  # no live counts yet: assume the calibration load (factor 1)
            self.ema = self.prior.copy()
            self._update_hot()
        self._dirty = True

    def set_residual(self, residual: np.ndarray | None) -> None:
        """Prompt-residual factor: per block [n] (e.g. fit-residual's per-layer factor spread
        over the layer's blocks: scales each curve, so the cached hulls stand), or per block and
        width [n, K] (reshapes the curves: hulls are rebuilt at the next decision); None: ones."""
        r = None if residual is None else np.asarray(residual)
        if r is not None and r.shape not in ((self.n,), (self.n, self.K)):
            raise ValueError(f"residual must be [{self.n}] or [{self.n}, {self.K}]")
        self._shape = None
        if r is not None and r.ndim == 2:
            self._res_block, self._res_width = None, np.ascontiguousarray(r.T, np.float32)
            self._hull_floors = None
        else:
            if self._res_width is not None:
                self._hull_floors = None
            self._res_block = None if r is None else r.astype(np.float32)
            self._res_width = None
        self._dirty = True

    def share(self) -> np.ndarray:
        """Per block, its expert's EMA routing share relative to its layer's mean (1: average)."""
        self._refresh()
        return self._share

    def floors(self) -> np.ndarray:
        """Lowest allowed width index per block (bits - min_bits)."""
        self._refresh()
        return self._floors

    def shape(self, cols: np.ndarray | None = None) -> np.ndarray:
        """[K, n] damage curves up to a per-block factor: base (x the per-width residual);
        `cols`: those blocks only."""
        if not (self.cfg.use_residual and self._res_width is not None):
            return self.base if cols is None else self.base[:, cols]
        if self._shape is None:
            self._shape = self.base * self._res_width
        return self._shape if cols is None else self._shape[:, cols]

    def scale(self) -> np.ndarray:
        """[n] per-block factor: hot-expert factor x per-block residual, as switched on."""
        self._refresh()
        return self._scale

    def effective_damage(self) -> np.ndarray:
        """[K, n]: base x hot factor x residual, as the switches allow."""
        return self.shape() * self.scale()

    def _refresh(self) -> None:
        if not self._dirty:
            return
        cfg = self.cfg
        s = self._layer_share()
        self._share = np.append(s.ravel(), 1.0)[self._slot]
        f = self._base_floor.copy()
        scale = np.ones(self.n, np.float32)
        if cfg.use_router_stats:
            hot = np.append(self.hot.ravel(), False)[self._slot]
            np.maximum(f, hot * self._hot_floor, out=f)
            live = np.append((s / self.prior).ravel(), 1.0)[self._slot]
            scale[:] = np.clip(live, 1.0 / cfg.hot_cap, cfg.hot_cap)
        if cfg.use_residual and self._res_block is not None:
            scale *= self._res_block
        if self.relaxed:
            f = np.zeros_like(f)
        self._floors, self._scale = f, scale
        self._dirty = False

    @property
    def widths(self) -> np.ndarray:
        return (self.k + self.min_bits).astype(np.int8)

    def bytes(self) -> int:
        """Device bytes of the wanted widths."""
        return self._cost(self.k)

    def adopt(self, widths: np.ndarray) -> None:
        """Take these widths (bits) as the current ones, e.g. the pager's `wanted` after a copy
        failed and left a block where it was."""
        k = np.asarray(widths, dtype=np.int64) - self.min_bits
        if k.shape != (self.n,) or (k < 0).any() or (k >= self.K).any():
            raise ValueError(f"widths must be {self.min_bits}..{self.min_bits + self.K - 1}")
        self.k = k

    # --- decisions ------------------------------------------------------------------------------

    def plan(self, budget: int) -> Plan:
        """Full re-plan: from every block at its widest, free down to `budget` bytes."""
        if self._frozen():
            return self._idle(shortfall=max(0, self.bytes() - int(budget)))
        before = self.k.copy()
        self.k[:] = self.K - 1
        p = self._free(self._cost(self.k) - int(budget), before)
        self.demoted_at[self.k < before] = self.step
        self._planned = True
        return p

    def fit(self, budget: int) -> Plan:
        """What the engine calls each step: free the excess over `budget`, or promote into the
        spare bytes (the first call plans from scratch)."""
        if not self._planned:
            return self.plan(budget)
        over = self.bytes() - int(budget)
        return self.free(over) if over > 0 else self.promote(-over)

    def free(self, n_bytes: int) -> Plan:
        """Demote until `n_bytes` are freed, lowest damage per freed byte first; if the floors
        forbid it, free the most they allow and report the shortfall."""
        if self._frozen():
            return self._idle(shortfall=max(0, int(n_bytes)))
        old = self.k.copy()
        p = self._free(int(n_bytes), old)
        self.demoted_at[self.k < old] = self.step
        self._planned = True
        return p

    def promote(self, spare_bytes: int) -> Plan:
        """Promote within `spare_bytes`, most damage removed per added byte first. Hysteresis:
        a block demoted in the last `cooldown` steps stays down, and while the last demotion is
        that recent a promotion must beat its rate by `margin`."""
        if self._frozen():
            return self._idle()
        self._planned = True
        if (self.k == self.K - 1).all():  # every block at its widest (or the cap): nothing to
            return self._idle()  # do, and serving with memory to spare asks this every step
        cfg, old = self.cfg, self.k.copy()
        spare = int(spare_bytes) - self._raise_floors()
        added, value, ok = self._segments(up=True)
        recent = self.step - self.last_free < cfg.cooldown
        # while a demotion is recent a promotion must beat its rate; otherwise any promotion
        # the spare bytes allow, worthless ones last (zero-damage segments included: after a
        # burst, blocks go back to the widest width the memory allows)
        ok &= value > self.last_rate * (1 + cfg.margin) if recent else value >= 0.0
        ok &= (self.step - self.demoted_at >= cfg.cooldown)[None, :]
        bits = np.float32(np.inf).view(np.uint32) - value.view(np.uint32)  # descending value
        taken, last, skipped, _ = _select(
            bits, added, ok, spare / self.unit, self._tie_up, False, self._min_step, self._ws
        )
        self.k = _move(self.k, taken, up=True)
        first = np.where(taken, value, -1.0).max(axis=0)  # each block's first (best) move
        moved = np.flatnonzero(self.k != old)
        p = Plan(self.widths, moved[np.argsort(-first[moved], kind="stable")])
        p.rate = float(value.flat[last]) if last >= 0 else 0.0
        if skipped >= 0:
            p.bound = float(value.flat[skipped]) * float(added.flat[skipped]) * self.unit
        return self._rebase(p, old)

    # --- internals ------------------------------------------------------------------------------

    def _frozen(self) -> bool:
        return self._planned and not self.cfg.dynamic_paging

    def _cost(self, k: np.ndarray) -> int:
        return int(self.c.ravel()[k * self.n + self._ar].sum())

    def _damage(self, k: np.ndarray) -> float:
        return float(np.dot(self.shape().ravel()[k * self.n + self._ar], self.scale()))

    def _idle(self, shortfall: int = 0) -> Plan:
        return Plan(
            self.widths, np.zeros(0, np.int64), damage=self._damage(self.k), shortfall=shortfall
        )

    def _raise_floors(self) -> int:
        """Blocks below their floor (an expert turned hot) go up to it before anything else;
        returns the bytes that costs."""
        f = self.floors()
        low = np.flatnonzero(self.k < f)
        c = self.c.ravel()
        added = int((c[f[low] * self.n + low] - c[self.k[low] * self.n + low]).sum())
        self.k[low] = f[low]
        return added

    def _segments(self, up: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Hull segments from the current widths: down to each lower vertex (up=False) or up
        to each higher one, as (bytes, rate x scale, mask) [K, n]; bytes only mean something
        where the mask is set. The hull over floor..widest is cached (per-block factors do not
        move its vertices); while every current width is one of its vertices, the hull over
        floor..width (width..widest) is its part below (above) the width. Otherwise the
        restricted hulls are built afresh."""
        f, ws, K, n = self.floors(), self._ws, self.K, self.n
        self._update_hulls(f)
        cache = self._cache
        ok = _buf(ws, "seg_ok", (K, n), bool)
        if self.use_cache and cache["vert"].ravel()[self.k * n + self._ar].all():
            tag = "up" if up else "down"
            if tag not in self._walked:
                _walk(self._cu, cache, up, ws, cache, tag)
                self._walked.add(tag)
            moved, rate = cache[tag + "_moved"], cache[tag + "_rate"]
            (np.greater if up else np.less)(self._kk, self.k.astype(np.int8), out=ok)
            ok &= cache[tag + "_ok"]
        else:
            lo, hi = (self.k, np.full(n, K - 1)) if up else (f, self.k)
            out: dict[str, np.ndarray] = ws.setdefault("slow", {})
            _hull(self.c, self.shape(), self._inv, lo, hi, ws, out)
            _walk(self._cu, out, up, ws, out, "x")
            moved, rate = out["x_moved"], out["x_rate"]
            np.copyto(ok, out["x_ok"])
        scaled = _buf(ws, "seg_rate", (K, n), np.float32)
        np.multiply(rate, self.scale(), out=scaled)
        return moved, scaled, ok

    def _update_hulls(self, f: np.ndarray) -> None:
        """Rebuild the cached hulls over floor..widest where the floors moved (an expert
        turned hot or cooled down): those blocks only, unless many moved."""
        cols = None
        if self._hull_floors is not None:
            cols = np.flatnonzero(f != self._hull_floors)
            if not cols.size:
                return
            if cols.size > self.n // 4:
                cols = None
        top = np.full(self.n, self.K - 1)
        if cols is None:
            _hull(self.c, self.shape(), self._inv, f, top, self._ws, self._cache)
            self._walked = set()
        else:
            c, part = self.c[:, cols], dict[str, np.ndarray]()
            cu = self._cu[:, cols]
            _hull(
                c, self.shape(cols), [x[:, cols] for x in self._inv], f[cols], top[cols], {}, part
            )
            for tag in self._walked:
                _walk(cu, part, tag == "up", {}, part, tag)
            for name, new in part.items():
                self._cache[name][:, cols] = new
        self._hull_floors = f.copy()

    def _free(self, n_bytes: int, ref: np.ndarray) -> Plan:
        """Demote from the current widths; the plan's figures are relative to widths `ref`."""
        need = n_bytes + self._raise_floors()
        freed, rate, ok = self._segments(up=False)
        taken, last, _, got = _select(
            rate.view(np.uint32),
            freed,
            ok,
            need / self.unit,
            self._tie_down,
            True,
            self._min_step,
            self._ws,
        )
        self.k = _move(self.k, taken, up=False)
        shortfall = max(0, need - round(got) * self.unit)
        p = Plan(self.widths, np.zeros(0, np.int64), shortfall=shortfall)
        if last >= 0:
            self.last_rate, self.last_free = float(rate.flat[last]), self.step
            p.rate = self.last_rate
            p.bound = self.last_rate * float(freed.flat[last]) * self.unit
        p.order = np.flatnonzero(self.k != ref)
        return self._rebase(p, ref)

    def _rebase(self, p: Plan, ref: np.ndarray) -> Plan:
        """Fill the plan's byte and damage figures relative to the widths `ref`."""
        at_ref, at_new = ref * self.n + self._ar, self.k * self.n + self._ar
        c, d, scale = self.c.ravel(), self.shape().ravel(), self.scale()
        diff = c[at_new] - c[at_ref]
        p.bytes_added = int(np.maximum(diff, 0).sum())
        p.bytes_freed = -int(np.minimum(diff, 0).sum())
        p.damage = float(np.dot(d[at_new], scale))  # float32 dot: metrics, ~1e-6 relative
        p.damage_delta = p.damage - float(np.dot(d[at_ref], scale))
        return p


def _buf(ws: dict, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A reusable scratch array: fresh megabyte-sized temporaries cost more in page faults
    than the arithmetic done in them."""
    a = ws.get(name)
    if a is None or a.shape != shape or a.dtype != dtype:
        a = ws[name] = np.empty(shape, dtype)
    return a


def _hull(
    c: np.ndarray,
    d: np.ndarray,
    inv: list[np.ndarray],
    lo: np.ndarray,
    hi: np.ndarray,
    ws: dict,
    out: dict,
) -> None:
    """Lower convex hull of each block's points (c, d) [K, n] over widths lo..hi, into `out`:
    "vert" the vertex mask, "left" / "right" per point the steepest slope arriving from the
    left and the flattest leaving to the right. Point k is a vertex iff left[k] < right[k]
    (some line through it passes below every other point); near-collinear points are not
    vertices, so kept segments' rates strictly order. `inv[i]` = 1 / (c[i+1:] - c[i]); `ws`:
    scratch arrays. Masks enter as arithmetic, not `where=` (masked numpy ops on scattered
    masks are 10-40x slower); float32 halves the memory traffic."""
    K, n = d.shape
    kk = np.arange(K, dtype=np.int8)[:, None]
    lo8, hi8 = lo.astype(np.int8), hi.astype(np.int8)
    act, off = _buf(ws, "act", (K, n), bool), _buf(ws, "off", (K, n), bool)
    np.greater_equal(kk, lo8, out=act)
    np.less_equal(kk, hi8, out=off)
    act &= off
    dd = _buf(ws, "dd", (K, n), np.float32)
    np.copyto(dd, d)
    # points outside lo..hi sit far above every line through the rest (only the rows where
    # some block has such a point)
    for k in [*range(int(lo8.max())), *range(int(hi8.min()) + 1, K)]:
        np.logical_not(act[k], out=off[k])
        dd[k] += off[k] * FAR
    left, right = _buf(out, "left", (K, n), np.float32), _buf(out, "right", (K, n), np.float32)
    left.fill(-BIG)
    right.fill(BIG)
    s = _buf(ws, "s", (K - 1, n), np.float32)
    for i in range(K - 1):  # slopes from point i to every point above it
        si = s[: K - 1 - i]
        np.subtract(dd[i + 1 :], dd[i], out=si)
        si *= inv[i]
        np.minimum.reduce(si, axis=0, out=right[i])
        np.maximum(left[i + 1 :], si, out=left[i + 1 :])
    np.abs(right, out=dd)
    dd *= -TOL
    dd += right
    vert = _buf(out, "vert", (K, n), bool)
    np.less(left, dd, out=vert)
    vert &= act


def _walk(c: np.ndarray, hull: dict, up: bool, ws: dict, out: dict, tag: str) -> None:
    """From the hull's vertices, into `out` under `tag`: "_moved" the bytes from each vertex
    to the nearest vertex below it (up) or above it (down), meaningful only where "_ok" (the
    vertices that have one) is set, and "_rate" the damage per byte along that edge, >= 0 so
    that float32 bit patterns order like the values (the hull's own edge at a vertex is the
    steepest slope in (left) or the flattest out (right)). A running max / min over vertex
    costs along the widths (costs grow with width); row loops, as ufunc.accumulate along
    axis 0 is 20x slower."""
    K, n = c.shape
    vert, far = hull["vert"], c.dtype.type(-FAR if up else FAR)
    off, cv = _buf(ws, "off", (K, n), bool), _buf(ws, "cv", (K, n), c.dtype)
    np.logical_not(vert, out=off)
    np.multiply(off, far, out=cv)
    cv += c
    near = _buf(ws, "near", (K, n), c.dtype)
    near[0 if up else -1] = far
    for k in range(1, K) if up else range(K - 2, -1, -1):
        j = k - 1 if up else k + 1
        (np.maximum if up else np.minimum)(near[j], cv[j], out=near[k])
    moved = _buf(out, tag + "_moved", (K, n), np.float64)  # float64: bincount's weights
    np.subtract(c, near, out=moved) if up else np.subtract(near, c, out=moved)
    ok = _buf(out, tag + "_ok", (K, n), bool)
    np.not_equal(near, far, out=ok)
    ok &= vert
    rate = _buf(out, tag + "_rate", (K, n), np.float32)
    np.negative(hull["left"] if up else hull["right"], out=rate)
    np.clip(rate, 0.0, FAR, out=rate)  # no overflow once scaled where there is no edge
    rate += 0.0  # -0.0 + 0.0 = +0.0: -0.0's bit pattern would sort after every rate


def _select(
    bits: np.ndarray,
    size: np.ndarray,
    ok: np.ndarray,
    budget: float,
    tie: tuple[np.ndarray, np.ndarray],
    cross: bool,
    min_size: float,
    ws: dict,
) -> tuple[np.ndarray, int, int, float]:
    """Greedy over the segments `ok`, in increasing `bits` then tie rank: cross=True takes them
    until their sizes reach `budget` (the one crossing it included), cross=False while they fit
    in it. Returns the taken mask [K, n], the flat indices of the last segment taken and of the
    first one passed over (-1: none) and the bytes taken. Never a full sort: a small budget
    touches at most budget / min_size + 2 segments, found by one partition; otherwise a byte
    histogram over the top 12 key bits (exponent and 3 mantissa bits) finds the bucket where
    the budget falls and only that bucket is sorted. `ws`: scratch arrays."""
    rank, flat_of = tie  # rank: [K, n] tie-break order; flat_of[rank] = flat index
    taken = _buf(ws, "taken", ok.shape, bool)
    taken.fill(False)
    if budget <= 0 and cross:
        return taken, -1, -1, 0.0
    side: Literal["left", "right"] = "left" if cross else "right"
    m = int(max(budget, 0) // max(min_size, 1.0)) + 2
    before = 0.0
    if m < ok.shape[1] // 8:  # the first m + 1 segments in order hold every one we may touch
        idx = np.flatnonzero(ok)
        if not idx.size:
            return taken, -1, -1, 0.0
        key = bits.ravel()[idx]
        kth = key[np.argpartition(key, m)[m]] if m < idx.size else key.max()
        head = _ordered(bits, rank, flat_of, idx[key <= kth])
    else:
        # missing segments go to bucket 0xFFF, past every real key (0 .. 0x7F8 = inf); intp
        # buckets and float64 weights spare bincount its own megabyte-sized conversions
        off, key = _buf(ws, "off", ok.shape, bool), _buf(ws, "key", ok.shape, np.uint32)
        np.logical_not(ok, out=off)
        np.multiply(off.view(np.uint8), np.uint32(0xFFFFFFFF), out=key)
        key |= bits
        bucket = _buf(ws, "bucket", ok.shape, np.intp)
        np.right_shift(key, np.uint32(20), out=bucket, casting="unsafe")
        cum = np.cumsum(np.bincount(bucket.ravel(), weights=size.ravel(), minlength=NB)[:NB])
        b = int(np.searchsorted(cum, budget, side=side))
        np.less(bucket, b, out=taken)
        if b == NB:  # the budget is never reached: every segment is taken
            return taken, _last(bits, rank, flat_of, np.flatnonzero(taken)), -1, float(cum[-1])
        before = float(cum[b - 1]) if b else 0.0
        head = _ordered(bits, rank, flat_of, np.flatnonzero(bucket.ravel() == b))
    run = np.cumsum(size.ravel()[head]) + before
    j = int(np.searchsorted(run, budget, side=side))
    j = min(j + 1, head.size) if cross else j
    taken.ravel()[head[:j]] = True
    last = int(head[j - 1]) if j else _last(bits, rank, flat_of, np.flatnonzero(taken))
    got = float(run[j - 1]) if j else before
    return taken, last, int(head[j]) if j < head.size else -1, got


def _ordered(bits: np.ndarray, rank: np.ndarray, flat_of: np.ndarray, idx: np.ndarray):
    """Flat indices `idx` sorted by key then tie rank: uint64 keys (float32 bits over the
    32-bit rank) sort in one np.sort, 3x faster than argsort."""
    keys = (bits.ravel()[idx].astype(np.uint64) << np.uint64(32)) | rank.ravel()[idx]
    return flat_of[(np.sort(keys) & MASK32).astype(np.intp)]


def _last(bits: np.ndarray, rank: np.ndarray, flat_of: np.ndarray, idx: np.ndarray) -> int:
    """The last of `idx` in key order (-1 if none)."""
    return int(_ordered(bits, rank, flat_of, idx)[-1]) if idx.size else -1


def _move(k: np.ndarray, taken: np.ndarray, up: bool) -> np.ndarray:
    """New width index per block after the taken segments [K, n]. They are a prefix of each
    block's chain (convex hull, ties widest-first down / narrowest-first up), so the farthest
    one decides. int8 rows: 8x less memory traffic than int64."""
    new = k.astype(np.int8)
    K = taken.shape[0]
    for r in range(K):
        row = taken[r].view(np.int8)
        if up:
            np.maximum(new, row * np.int8(r), out=new)
        else:
            np.minimum(new, np.int8(K) - row * np.int8(K - r), out=new)
    return new.astype(np.int64)
