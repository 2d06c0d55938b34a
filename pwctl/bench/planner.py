"""Planner latency on a Qwen3-MoE-sized page table (48 layers x 128 experts x gate/up/down,
widths 2..8): full re-plan, cold re-plan (every hull rebuilt) and incremental update; see
`run_planner_bench`. Plane bytes follow the pack format; damage curves are synthetic (log-normal
block sensitivity x 4^-bits x noise, so some curves are not convex).
`python -m pwctl.bench.planner` prints the figures as JSON."""

from __future__ import annotations

import time

import numpy as np

from pwctl.build.convert import rows_per_table
from pwctl.format.residual import ResidualModel
from pwctl.runtime.memory.page_table import PageTable
from pwctl.runtime.widths.allocator import router_counts
from pwctl.runtime.widths.planner import Planner, PlannerConfig


def synthetic_table(
    layers: int = 48,
    experts: int = 128,
    hidden: int = 2048,
    inter: int = 768,
    min_bits: int = 2,
    max_bits: int = 8,
    budget: float = 0.35,
) -> PageTable:
    """A page table with the pack's plane sizes for this shape; budget: fraction of fp16."""
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    per_block = []
    for rows, cols in shapes.values():
        words, rpt = -(-cols // 32), rows_per_table(rows, cols, 1024)
        table = [(rows // rpt) * 2 ** (p + 1) * 2 if p + 1 >= min_bits else 0 for p in range(8)]
        per_block.append([rows * words * 4 + table[p] for p in range(max_bits)])
    n = layers * experts * 3
    pb = np.tile(np.array(per_block, dtype=np.int64), (layers * experts, 1))
    fp16 = layers * experts * sum(r * c * 2 for r, c in shapes.values())
    layer = np.repeat(np.arange(layers), experts * 3)
    expert = np.tile(np.repeat(np.arange(experts), 3), layers)
    return PageTable(
        pb, min_bits, int(budget * fp16), layer=layer, expert=expert, shared=np.zeros(n, bool)
    )


def synthetic_damage(table: PageTable, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    widths = np.arange(table.min_bits, table.max_bits + 1)
    sens = rng.lognormal(0.0, 1.0, size=(table.n_blocks, 1))
    noise = rng.lognormal(0.0, 0.3, size=(table.n_blocks, widths.size))
    return sens * 4.0 ** -widths[None, :] * noise


def _median_ms(fn, repeats: int) -> tuple[float, float]:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts)), 1e3 * float(np.percentile(ts, 90))


def run_planner_bench(repeats: int = 200, seed: int = 0) -> dict:
    """Median and p90 milliseconds of three decisions on the Qwen3-MoE-sized table:
    - full re-plan: fresh router counts and a per-block prompt residual (fit-residual's
      per-layer factor), every block planned from its widest width down to the budget;
      per-block factors leave the cached hulls standing;
    - cold re-plan: the same with a per-(block, width) residual, so every hull is rebuilt;
    - incremental: one step's router counts, then free or promote the 8 MB the KV cache took
      or gave back;
    - at the top: one step's router counts, then the serving engine's promotion into spare
      memory with every block already at its widest (no pressure, or a --max-bits cap);
    - serving step: the whole of a serving step's planner work (`WidthAllocator.feed` of a
      decode step of 16 sequences routed with a skew, `skewed_routing`: router counts and a
      usable residual's per-layer factor; then the KV cache takes or gives back 8 MB), and
      how many blocks' floors a step moves (`serving_step_floor_changes`)."""
    table = synthetic_table()
    damage = synthetic_damage(table, seed)
    planner = Planner.from_table(table, damage, PlannerConfig())
    budget = table.budget_bytes
    rng = np.random.default_rng(seed + 1)
    K, n = planner.K, planner.n
    layer_factor = rng.lognormal(0.0, 0.2, size=(2, 48))
    per_width = rng.lognormal(0.0, 0.1, size=(2, n, K))
    counts = rng.poisson(8 * 64 / 128, size=(2, 48, 128)).astype(np.float64)
    step_counts = rng.poisson(4, size=(repeats + 1, 48, 128)).astype(np.float64)
    i = [0]

    def full() -> None:
        i[0] ^= 1
        planner.set_residual(layer_factor[i[0]][table.layer])
        planner.observe(counts[i[0]])
        planner.plan(budget)

    def cold() -> None:
        i[0] ^= 1
        planner.set_residual(per_width[i[0]])
        planner.observe(counts[i[0]])
        planner.plan(budget)

    def incremental() -> None:
        i[0] ^= 1
        planner.tick()
        planner.observe(step_counts[planner.step % len(step_counts)])
        planner.fit(budget - (8 << 20) * i[0])  # the KV cache takes 8 MB, then gives it back

    widest = int(table.cost_at[:, table.max_bits].sum())

    def at_top() -> None:
        planner.tick()
        planner.observe(step_counts[planner.step % len(step_counts)])
        planner.fit(2 * widest)

    residual = ResidualModel(
        list(range(48)), [0.0] * 3, [1.0] * 3, rng.normal(0, 0.1, (48, 3)).tolist(), [0.0] * 48, {}
    )
    ids = skewed_routing(rng, repeats + 2)
    feats = rng.lognormal(0.0, 0.2, size=(2, 48, 3))
    floor_changes = [0, 0]  # summed over serving steps, steps

    def serving_step() -> None:
        i[0] ^= 1
        before = planner.floors().copy()
        planner.set_residual(residual.layer_factors(list(range(48)), feats[i[0]])[table.layer])
        planner.observe(router_counts(ids[floor_changes[1] % len(ids)], 128))
        planner.tick()
        planner.fit(budget - (8 << 20) * i[0])
        floor_changes[0] += int((planner.floors() != before).sum())
        floor_changes[1] += 1

    out = {"blocks": n, "widths": f"{table.min_bits}..{table.max_bits}"}
    cases = (("full_replan", full), ("cold_replan", cold), ("incremental", incremental),
             ("at_top", at_top), ("serving_step", serving_step))  # fmt: skip
    for name, fn in cases:
        if name in ("incremental", "serving_step"):
            planner.set_residual(layer_factor[0][table.layer])
            planner.plan(budget)
        if name == "at_top":
            planner.plan(2 * widest)
        fn()
        med, p90 = _median_ms(fn, repeats)
        out[f"{name}_ms"], out[f"{name}_p90_ms"] = round(med, 3), round(p90, 3)
    out["serving_step_floor_changes"] = round(floor_changes[0] / floor_changes[1], 1)
    out["repeats"] = repeats
    return out


def skewed_routing(rng: np.random.Generator, steps: int, tokens: int = 16 * 8) -> np.ndarray:
    """Expert ids [steps, 48, tokens] of decode steps (16 sequences, top-8): each layer's 128
    experts drawn with Zipf(0.8) weights in an order of its own, so some are steadily hot and
    some waver near the hot threshold."""
    weights = 1.0 / np.arange(1, 129) ** 0.8
    order = np.stack([rng.permutation(128) for _ in range(48)])
    draws = rng.choice(128, size=(steps, 48, tokens), p=weights / weights.sum())
    return np.take_along_axis(order[None], draws, axis=2)


if __name__ == "__main__":
    import json

    print(json.dumps(run_planner_bench(), indent=1))
