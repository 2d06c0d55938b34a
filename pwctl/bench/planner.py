"""Planner latency on a Qwen3-MoE-sized page table (48 layers x 128 experts x gate/up/down,
widths 2..8): a full re-plan (every signal fresh, hulls rebuilt, free from the widest widths down
to the budget) and an incremental update (one step of router counts, then free or promote the
few MB the budget moved). Plane bytes follow the pack format; damage curves are synthetic
(log-normal block sensitivity x 4^-bits x noise, so some curves are not convex)."""

from __future__ import annotations

import time

import numpy as np

from pwctl.convert import rows_per_table
from pwctl.runtime.page_table import PageTable
from pwctl.runtime.planner import Planner, PlannerConfig

QWEN3_MOE = {"layers": 48, "experts": 128, "hidden": 2048, "inter": 768, "top_k": 8}


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
    """Median and p90 milliseconds of a full re-plan and of an incremental update."""
    table = synthetic_table()
    damage = synthetic_damage(table, seed)
    planner = Planner.from_table(table, damage, PlannerConfig(cooldown=0))
    budget = table.budget_bytes
    rng = np.random.default_rng(seed + 1)
    K, n = planner.K, planner.n
    residual = rng.lognormal(0.0, 0.1, size=(n, K))
    counts = rng.poisson(8 * 64 / 128, size=(48, 128)).astype(np.float64)

    def full() -> None:
        planner.set_residual(residual)
        planner.observe(counts)
        planner.plan(budget)

    full()
    full_ms, full_p90 = _median_ms(full, repeats)
    swing = [budget - (8 << 20), budget]  # the KV cache takes 8 MB, then gives it back
    step = [0]

    def incremental() -> None:
        planner.tick()
        planner.observe(rng.poisson(4, size=(48, 128)))
        planner.fit(swing[step[0] % 2])
        step[0] += 1

    inc_ms, inc_p90 = _median_ms(incremental, repeats)
    return {
        "blocks": n,
        "widths": f"{table.min_bits}..{table.max_bits}",
        "segments": n * (K - 1),
        "full_replan_ms": round(full_ms, 3),
        "full_replan_p90_ms": round(full_p90, 3),
        "incremental_ms": round(inc_ms, 3),
        "incremental_p90_ms": round(inc_p90, 3),
        "repeats": repeats,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run_planner_bench(), indent=1))
