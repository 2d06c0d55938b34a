"""pwctl fit-residual PACK: the prompt-residual regressor, stored as plain JSON in the pack."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pwctl.commands import checks
from pwctl.commands.common import console, handles_errors, print_table, write_json


@handles_errors
def run(
    pack: Annotated[Path, typer.Argument(help="pack folder (profiled)")],
    test_split: Annotated[float, typer.Option(help="share of sequences held out")] = 0.2,
    json: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """Fit log(damage_seq / damage_mean) ~ input-norm features, per MoE layer (ridge)."""
    checks.between("--test-split", test_split, 0, 1, open_=True)
    from pwctl.build.residual import fit
    from pwctl.runtime.engine.engine import open_pack

    p = open_pack(pack)
    model = fit(p, test_split)
    model.save(p)
    m = model.metrics
    print_table(
        "prompt residual (held-out sequences)",
        ("metric", "model", "average only"),
        [
            ("R^2 of log ratio", m["r2_test"], m["r2_test_average_only"]),
            ("Spearman of damage", m["spearman_test"], m["spearman_test_average_only"]),
            ("Spearman within block x width", m["spearman_within_block_width"], "n/a"),
        ],
    )
    if not model.usable:
        console.print("held-out R^2 is below 0.1: pagedweight policies will not use this model")
    write_json(json, m)
