"""Planner: greedy on convex hulls against brute force (within the stated integral bound), floors,
signals and their ablation switches, hysteresis, and the Qwen3-MoE-sized benchmark."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pwctl.policy import parse_policy
from pwctl.runtime.widths.planner import Planner, PlannerConfig

PLAIN = PlannerConfig(use_router_stats=False, cooldown=0, margin=0.0)


def instance(seed: int, n: int = 4, K: int = 4, equal: bool = False):
    """Random costs [n, K] (growing) and damage curves (decreasing on average, noisy, so some
    are not convex and some not even monotone)."""
    rng = np.random.default_rng(seed)
    planes = rng.integers(200, 2000, size=(1 if equal else n, K)).repeat(n if equal else 1, 0)
    cost = np.cumsum(planes, axis=1) + 1000
    sens = rng.lognormal(0, 1, size=(n, 1))
    damage = sens * 4.0 ** -np.arange(K) * rng.lognormal(0, 0.5, size=(n, K))
    return cost.astype(np.int64), damage


def rel_damage(damage: np.ndarray) -> np.ndarray:
    return np.clip(damage - damage[:, -1:], 0, None)


def hull_segments(cost, d, lo, hi):
    """Reference lower hull (monotone chain) of one block over widths lo..hi: list of
    (bytes, damage, upper vertex, lower vertex) going down from hi."""
    pts = [(float(cost[k]), float(d[k]), k) for k in range(lo, hi + 1)]
    chain: list = []
    for p in pts:
        while len(chain) >= 2:
            (x1, y1, _), (x2, y2, _) = chain[-2], chain[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:
                chain.pop()
            else:
                break
        chain.append(p)
    return [(b[0] - a[0], a[1] - b[1], b[2], a[2]) for a, b in itertools.pairwise(chain)][::-1]


def fractional_free(cost, d, need):
    """Fractional optimum of freeing `need` bytes from the widest widths (greedy on hulls)."""
    segs = [s for b in range(len(cost)) for s in hull_segments(cost[b], d[b], 0, len(d[b]) - 1)]
    segs.sort(key=lambda s: s[1] / s[0])
    total = 0.0
    for size, dmg, *_ in segs:
        if need <= 0:
            break
        take = min(1.0, need / size)
        total += take * dmg
        need -= take * size
    return total


def brute(cost, d, ok):
    """min damage over every width choice whose total cost passes `ok`."""
    n, K = cost.shape
    best = np.inf
    for ks in itertools.product(range(K), repeat=n):
        c = sum(cost[b, k] for b, k in enumerate(ks))
        if ok(c):
            best = min(best, sum(d[b, k] for b, k in enumerate(ks)))
    return best


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.floats(0.0, 1.0))
def test_free_matches_brute_force_within_bound(seed, frac):
    cost, damage = instance(seed)
    d = rel_damage(damage)
    lo, hi = cost[:, 0].sum(), cost[:, -1].sum()
    budget = int(lo + frac * (hi - lo))
    planner = Planner(cost, damage, 2, config=PLAIN)
    plan = planner.plan(budget)
    k = plan.widths.astype(int) - 2
    got_cost = cost[np.arange(4), k].sum()
    got = d[np.arange(4), k].sum()
    assert got_cost <= budget and plan.shortfall == 0
    opt = brute(cost, d, lambda c: c <= budget)
    frac_opt = fractional_free(cost, d, hi - budget)
    eps = 1e-4 * (d.sum() + 1e-12)  # float32 damage arithmetic
    assert frac_opt <= opt + eps  # the hull relaxation is a lower bound
    assert opt <= got + eps
    # the stated bound: greedy exceeds the fractional (so the integral) optimum by at most the
    # damage of the last segment, the one the fractional optimum needs only in part
    assert got <= frac_opt + plan.bound + eps
    assert plan.bytes_freed == hi - got_cost
    assert plan.damage == pytest.approx(d[np.arange(4), k].sum(), rel=1e-4, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.floats(0.0, 1.0))
def test_promote_matches_brute_force_within_bound(seed, frac):
    cost, damage = instance(seed)
    d = rel_damage(damage)
    lo, hi = cost[:, 0].sum(), cost[:, -1].sum()
    planner = Planner(cost, damage, 2, config=PLAIN)
    planner.plan(lo)  # everything at the narrowest width
    spare = int(frac * (hi - lo))
    plan = planner.promote(spare)
    k = plan.widths.astype(int) - 2
    assert cost[np.arange(4), k].sum() <= lo + spare
    got = d[np.arange(4), k].sum()
    opt = brute(cost, d, lambda c: c <= lo + spare)
    eps = 1e-4 * (d.sum() + 1e-12)
    assert opt <= got + eps
    assert got <= opt + plan.bound + eps  # bound: the first segment that did not fit
    assert plan.bytes_added == cost[np.arange(4), k].sum() - lo


@pytest.mark.parametrize("equal", [False, True])
def test_large_instance_matches_reference_greedy(equal):
    """Vectorized hulls and the bucketed selection against a plain-Python greedy, with many
    ties when every block has the same costs and curve shape (the uniform ablation)."""
    n, K = 600, 7
    cost, damage = instance(7, n, K, equal)
    if equal:
        damage = np.tile(damage[:1], (n, 1))
    d = rel_damage(damage)
    planner = Planner(cost, damage, 2, config=PLAIN)
    for frac in (0.05, 0.3, 0.77, 1.0):
        need = int(frac * (cost[:, -1] - cost[:, 0]).sum())
        plan = planner.plan(int(cost[:, -1].sum() - need))
        k = plan.widths.astype(int) - 2
        got = d[np.arange(n), k].sum()
        ref = fractional_free(cost, d, need)
        assert cost[:, -1].sum() - cost[np.arange(n), k].sum() >= need
        assert ref - 1e-4 * d.sum() <= got <= ref + plan.bound + 1e-4 * d.sum()


def test_floors_shortfall_and_hot_experts():
    n_layers, n_exp = 2, 4
    layer = np.repeat(np.arange(n_layers), (n_exp + 1) * 3)
    expert = np.tile(np.repeat(np.arange(n_exp + 1), 3), n_layers)
    shared = expert == n_exp
    n = layer.size
    cost, damage = instance(3, n, 7)
    planner = Planner(cost, damage, 2, layer, expert, shared, PlannerConfig())
    counts = np.ones((n_layers, n_exp))
    counts[0, 1] = 40  # expert 1 of layer 0 takes most tokens: hot
    for _ in range(30):
        planner.observe(counts)
    hot = (layer == 0) & (expert == 1)
    plan = planner.plan(0)  # impossible: everything goes to its floor, shortfall reported
    w = plan.widths
    assert (w[shared] == 4).all() and (w[hot] == 3).all() and (w[~shared & ~hot] == 2).all()
    floor_bytes = cost[np.arange(n), w - 2].sum()
    assert plan.shortfall == floor_bytes
    assert planner.free(10**6).shortfall == 10**6  # nothing left to free
    # the expert cools down and another turns hot: its floor rises at the next decision
    counts[0, 1], counts[1, 2] = 1, 40
    for _ in range(60):
        planner.observe(counts)
    plan = planner.free(0)
    newly = (layer == 1) & (expert == 2)
    assert (plan.widths[newly] >= 3).all() and plan.bytes_added > 0
    assert (plan.widths >= planner.floors() + 2).all()


def test_hot_experts_cool_below_a_lower_share():
    # hysteresis: an expert turns hot at 2x its layer's mean and cools only below 1.5x, so one
    # whose share wavers around 2x keeps its floor instead of moving it every step
    layer, expert = np.zeros(12, int), np.repeat(np.arange(4), 3)
    cost, damage = instance(5, 12, 7)
    planner = Planner(cost, damage, 2, layer, expert, config=PlannerConfig(ema=1.0))

    def floor_after(share: float) -> int:  # expert 0 at `share` x the mean, the rest equal
        planner.observe(np.array([[3 * share / (4 - share), 1, 1, 1]]))
        return int(planner.floors()[0])

    assert floor_after(1.9) == 0
    assert [floor_after(s) for s in (2.2, 1.8, 2.2, 1.6, 1.9)] == [1] * 5
    assert floor_after(1.4) == 0 and floor_after(1.9) == 0
    with pytest.raises(ValueError, match="hot_leave"):
        Planner(cost, damage, 2, layer, expert, config=PlannerConfig(hot_leave=2.5))


def test_signals_and_ablations():
    cost = np.tile(np.cumsum(np.full(7, 1000)), (2, 1))
    damage = np.tile(4.0 ** -np.arange(7), (2, 1))
    budget = int(cost[0, 2] + cost[0, 4])
    layer, expert = np.zeros(2, int), np.arange(2)
    counts = np.array([[30.0, 1.0]])
    # router stats: the hot expert (0) keeps more bits than its twin
    on = Planner(cost, damage, 2, layer, expert, config=PlannerConfig(hot_floor=0))
    for _ in range(30):
        on.observe(counts)
    w = on.plan(budget).widths
    assert w[0] > w[1]
    off = Planner(
        cost,
        damage,
        2,
        layer,
        expert,
        config=PlannerConfig.from_policy(parse_policy("pagedweight-router:0.3"), hot_floor=0),
    )
    for _ in range(30):
        off.observe(counts)
    w = off.plan(budget).widths
    assert abs(int(w[0]) - int(w[1])) <= 1  # twins: the same up to one step
    assert off.share()[0] > 1 and not off.cfg.use_router_stats
    assert np.array_equal(off.effective_damage(), off.base)
    # residual: block 1 made 10x more sensitive keeps more bits; ignored when switched off
    res = np.ones((2, 7))
    res[1] = 10
    for name, wins in (("pagedweight", True), ("pagedweight-residual", False)):
        p = Planner(cost, damage, 2, config=PlannerConfig.from_policy(parse_policy(f"{name}:1")))
        p.set_residual(res)
        w = p.plan(budget).widths
        assert (w[1] > w[0]) == wins
    # dynamic paging off: the first plan stands
    frozen = Planner(cost, damage, 2, config=PlannerConfig(dynamic_paging=False))
    w0 = frozen.plan(budget).widths
    assert np.array_equal(frozen.free(500).widths, w0) and frozen.free(500).shortfall == 500
    assert np.array_equal(frozen.promote(10**6).widths, w0)
    assert np.array_equal(frozen.fit(0).widths, w0)


def test_no_global_sensitivity_gives_uniform_widths():
    n = 40
    cost, damage = instance(11, n, 7, equal=True)  # same block shape, very different curves
    for frac in (0.2, 0.5, 0.8):
        budget = int(cost[:, 0].sum() + frac * (cost[:, -1] - cost[:, 0]).sum())
        cfg = PlannerConfig.from_policy(parse_policy(f"pagedweight-sensitivity:{frac}"))
        w = Planner(cost, damage, 2, config=cfg).plan(budget).widths
        assert w.max() - w.min() <= 1
        w = Planner(cost, damage, 2, config=PLAIN).plan(budget).widths
        assert w.max() - w.min() >= 2  # with sensitivity the allocation is not uniform


def test_from_policy():
    assert PlannerConfig.from_policy(parse_policy("pagedweight:0.3")) == PlannerConfig()
    for name, field in (
        ("router", "use_router_stats"),
        ("residual", "use_residual"),
        ("paging", "dynamic_paging"),
        ("sensitivity", "global_sensitivity"),
    ):
        cfg = PlannerConfig.from_policy(parse_policy(f"pagedweight-{name}:0.3"))
        assert getattr(cfg, field) is False
        assert (
            sum(
                not getattr(cfg, f)
                for f in (
                    "use_router_stats",
                    "use_residual",
                    "dynamic_paging",
                    "global_sensitivity",
                )
            )
            == 1
        )
    with pytest.raises(Exception, match="does not use"):
        PlannerConfig.from_policy(parse_policy("uniform:3"))


def alternate(cfg: PlannerConfig, steps: int = 64):
    n = 60
    cost, damage = instance(5, n, 7)
    planner = Planner(cost, damage, 2, config=cfg)
    hi = int(cost[:, 2:].mean(axis=1).sum())
    lo = hi - int(0.1 * hi)
    planner.plan(hi)
    history = [planner.widths.copy()]
    for step in range(steps):
        planner.tick()
        plan = planner.fit(lo if step % 2 == 0 else hi)
        assert planner.bytes() <= (lo if step % 2 == 0 else hi)  # never over budget
        history.append(plan.widths.copy())
    return np.array(history)


def test_hysteresis_prevents_oscillation():
    calm = alternate(PlannerConfig(use_router_stats=False, cooldown=16, margin=0.25))
    jumpy = alternate(PlannerConfig(use_router_stats=False, cooldown=0, margin=0.0))
    changes = lambda h: int((np.diff(h.astype(int), axis=0) != 0).sum())  # noqa: E731
    assert changes(jumpy) >= 60 and 4 * changes(calm) <= changes(jumpy)
    # no block goes back up within `cooldown` steps of going down
    down_at = np.full(calm.shape[1], -(10**9))
    for t in range(1, len(calm)):
        delta = calm[t].astype(int) - calm[t - 1]
        assert (t - down_at[delta > 0] >= 16).all()
        down_at[delta < 0] = t


def test_plan_reports_decisions():
    cost, damage = instance(2, 50, 7)
    planner = Planner(cost, damage, 2, config=PLAIN)
    full = int(cost[:, -1].sum())
    p = planner.plan(full // 2)
    assert p.bytes_freed >= full - full // 2 and p.bytes_added == 0
    assert p.damage_delta == pytest.approx(p.damage) and p.damage > 0
    assert p.rate > 0 and set(p.order) == set(np.flatnonzero(p.widths < 8))
    planner.adopt(p.widths)  # e.g. after a failed copy: the pager's widths are the truth
    q = planner.promote(full // 10)
    assert 0 < q.bytes_added <= full // 10 and q.damage_delta < 0
    assert q.damage == pytest.approx(p.damage + q.damage_delta, rel=1e-5)
    # most valuable first: the first promoted block's move beats the last one's
    assert len(q.order) >= 2


def test_promote_with_every_block_at_its_widest_moves_nothing():
    # serving with memory to spare calls fit every step with every block already at the top
    cost, damage = instance(3, 50, 7)
    planner = Planner(cost, damage, 2, config=PLAIN)
    full = int(cost[:, -1].sum())
    planner.plan(2 * full)
    for _ in range(3):
        planner.tick()
        p = planner.fit(2 * full)
        assert (p.widths == 8).all() and p.order.size == 0 and p.bytes_added == 0
        assert p.damage == 0 and p.damage_delta == 0
    planner.free(full // 3)  # below the top again: promotion takes the spare bytes back
    for _ in range(PLAIN.cooldown):
        planner.tick()
    assert planner.fit(2 * full).bytes_added > 0


def test_planner_bench_runs():
    from pwctl.bench.planner import run_planner_bench

    r = run_planner_bench(repeats=3)
    assert r["blocks"] == 48 * 128 * 3 and r["widths"] == "2..8"
    assert 0 < r["full_replan_ms"] < 1000 and 0 < r["incremental_ms"] < 1000
    assert 0 < r["at_top_ms"] < 1000 and 0 < r["serving_step_ms"] < 1000
    assert r["serving_step_floor_changes"] >= 0


def test_router_counts_count_each_layers_ids():
    from pwctl.runtime.widths.allocator import router_counts

    ids = np.random.default_rng(0).integers(0, 6, size=(3, 20))
    want = np.stack([np.bincount(row, minlength=6) for row in ids])
    assert np.array_equal(router_counts(ids, 6), want)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.lists(st.integers(0, 6), min_size=1, max_size=25))
def test_cached_hulls_decide_like_fresh_ones(seed, ops):
    """Cached hulls (kept across per-block factors, patched where floors move) against hulls
    built afresh for every decision: the same widths, every time."""
    rng = np.random.default_rng(seed)
    n_layers, n_exp = 3, 6
    layer = np.repeat(np.arange(n_layers), n_exp * 3)
    expert = np.tile(np.repeat(np.arange(n_exp), 3), n_layers)
    cost, damage = instance(seed, layer.size, 7)
    cfg = PlannerConfig(cooldown=2, ema=0.5)
    a, b = (Planner(cost, damage, 2, layer, expert, config=cfg) for _ in range(2))
    b.use_cache = False
    full = int(cost[:, -1].sum())
    for op in ops:
        if op == 0:
            counts = rng.poisson(rng.uniform(0.5, 20, size=(n_layers, n_exp)))
            args = ("observe", counts)
        elif op == 1:
            args = ("set_residual", rng.lognormal(0, 0.5, size=layer.size))
        elif op == 2:
            args = ("set_residual", rng.lognormal(0, 0.3, size=(layer.size, 7)))
        elif op == 3:
            args = ("plan", int(rng.uniform(0.2, 1.0) * full))
        elif op == 6:  # one expert turns hot (or back): few floors move
            counts = np.ones((n_layers, n_exp))
            counts[rng.integers(n_layers), rng.integers(n_exp)] = rng.choice([1.0, 60.0])
            args = ("observe", counts)
        elif op == 4:
            args = ("free", int(rng.uniform(0, 0.2) * full))
        else:
            args = ("promote", int(rng.uniform(0, 0.2) * full))
        for p in (a, b):
            p.tick()
            out = getattr(p, args[0])(args[1])
        if out is not None:  # a decision: the same widths, floors held
            assert np.array_equal(a.widths, b.widths), args[0]
            assert (a.widths >= a.floors() + 2).all()


def test_prior_share_turns_live_load_into_the_hot_factor():
    cost = np.tile(np.cumsum(np.full(7, 1000)), (2, 1))
    damage = np.tile(4.0 ** -np.arange(7), (2, 1))
    p = Planner(cost, damage, 2, np.zeros(2, int), np.arange(2))
    for _ in range(200):
        p.observe(np.array([[3.0, 1.0]]))
    assert p.scale()[0] == pytest.approx(1.5, rel=1e-3)  # 3x the load of its twin: 1.5 vs 0.5
    p.set_prior(np.array([[0.75, 0.25]]))  # calibration saw the same skew: nothing is hotter
    assert p.scale() == pytest.approx([1.0, 1.0], rel=1e-3)
    assert p.floors()[0] == 0  # hotness for floors stays absolute (share vs layer mean)
