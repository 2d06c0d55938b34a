"""bench --synthetic: pass key, needle and key-value retrieval over prose at several prompt
lengths and fact depths, on the serving engine per policy."""

from __future__ import annotations

from pathlib import Path

from pwctl.commands import checks
from pwctl.commands.bench_modes.shared import needs_pack, policies_or_default, serving_engines
from pwctl.commands.common import print_table, write_json
from pwctl.device import parse_device


def run(
    pack: Path | None,
    data: Path | None,
    policy: list[str] | None,
    tasks: list[str] | None,
    lengths: list[int] | None,
    depths: list[float] | None,
    examples: int | None,
    plot: Path | None,
    memory_budget: str | None,
    max_seqs: int | None,
    max_batch_tokens: int,
    max_bits: int | None,
    device: str,
    json: Path | None,
) -> None:
    checks.at_least("--examples", examples, 1)
    for n in lengths or []:
        checks.at_least("--lengths", n, 1)
    for d in depths or []:
        checks.between("--depths", d, 0, 1)
    device = parse_device(device)
    from pwctl.bench import synthetic_tasks as syn
    from pwctl.bench.longctx import memory_table, plot_scores
    from pwctl.build.checkpoint import EVAL_SAMPLE

    pack = needs_pack("--synthetic", pack)
    policies = policies_or_default(policy)
    spec, engines = serving_engines(
        pack, memory_budget, max_seqs, max_batch_tokens, max_bits, device
    )
    prose = data or EVAL_SAMPLE
    results = syn.run_synthetic(
        engines, policies, tasks or syn.TASKS, lengths or [256, 1024], examples or 10,
        depths=depths, prose_path=prose, spec=spec,
    )  # fmt: skip
    print_table(f"synthetic retrieval accuracy (prose: {prose.name})", *syn.table(results))
    points = syn.memory_points(results)
    print_table(*memory_table(points, "mean accuracy"))
    if plot is not None:
        plot_scores(points, plot, "synthetic retrieval accuracy")
    write_json(json, {"prose": str(prose), "results": [r.as_dict() for r in results]})
