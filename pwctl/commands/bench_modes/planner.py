"""bench --planner: the planner's latency on a Qwen3-MoE-sized table (CPU)."""

from __future__ import annotations

from pathlib import Path

from pwctl.commands.common import print_table, write_json


def run(json: Path | None) -> None:
    from pwctl.bench.planner import run_planner_bench

    figures = run_planner_bench()
    print_table(
        "planner latency, Qwen3-MoE-sized table (48 x 128 x 3 blocks)",
        ("case", "value"),
        [(k, v) for k, v in figures.items() if isinstance(v, int | float)],
    )
    write_json(json, figures)
