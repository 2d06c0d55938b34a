"""bench --longbench: LongBench v1 from its data folder on the serving engine, per policy: scores,
memory, prediction files."""

from __future__ import annotations

from pathlib import Path

from pwctl.commands import checks
from pwctl.commands.bench_modes.shared import needs_pack, policies_or_default, serving_engines
from pwctl.commands.common import console, print_table, write_json
from pwctl.device import parse_device
from pwctl.errors import PwctlError


def run(
    pack: Path | None,
    data: Path | None,
    policy: list[str] | None,
    paper_tasks: bool,
    tasks: list[str] | None,
    examples: int | None,
    save_predictions: Path | None,
    plot: Path | None,
    memory_budget: str | None,
    max_seqs: int | None,
    max_batch_tokens: int,
    max_bits: int | None,
    device: str,
    json: Path | None,
) -> None:
    checks.at_least("--examples", examples, 1)
    device = parse_device(device)
    from pwctl.bench import longbench as lb
    from pwctl.bench.longctx import memory_table, plot_scores

    pack = needs_pack("--longbench", pack)
    if paper_tasks and tasks:
        raise PwctlError("--paper-tasks or --tasks, not both")
    policies = policies_or_default(policy)
    spec, engines = serving_engines(
        pack, memory_budget, max_seqs, max_batch_tokens, max_bits, device
    )
    if data is None:
        raise PwctlError("bench --longbench needs --data DIR (LongBench's data folder)")
    chosen = lb.paper_tasks(data) if paper_tasks else tasks
    results = lb.run_longbench(engines, data, policies, chosen, examples, spec=spec)
    print_table(f"LongBench on {data} (score x100; examples)", *lb.table(results))
    points = lb.memory_points(results)
    print_table(*memory_table(points, "LongBench average"))
    if save_predictions is not None:
        saved = lb.save_predictions(results, save_predictions)
        console.print(f"wrote {len(saved)} prediction file(s) under {save_predictions}")
    if plot is not None:
        plot_scores(points, plot, "LongBench average score")
    write_json(json, lb.report(data, spec, results))
