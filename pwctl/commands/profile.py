"""pwctl profile PACK: per-block damage at every width, router statistics, norm features."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pwctl.commands import checks
from pwctl.commands.common import console, handles_errors, print_table, write_json
from pwctl.device import CHOICES, parse_device
from pwctl.errors import PwctlError


@handles_errors
def run(
    pack: Annotated[Path, typer.Argument(help="pack folder")],
    data: Annotated[list[Path] | None, typer.Option(help="text/jsonl; default: calib")] = None,
    samples: Annotated[int, typer.Option(help="calibration sequences")] = 16,
    seq_len: Annotated[int, typer.Option(help="tokens per sequence")] = 128,
    method: Annotated[str, typer.Option(help="measured (KL per block) or proxy")] = "measured",
    device: Annotated[str, typer.Option(help=CHOICES)] = "cpu",
    json: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """Measure what running each block at each width costs (written into the pack)."""
    checks.at_least("--samples", samples, 1)
    checks.at_least("--seq-len", seq_len, 2)  # the norm features take a spread over tokens
    device = parse_device(device)
    from pwctl.build.checkpoint import CALIB_SAMPLE
    from pwctl.build.profile import METHODS, run_profile
    from pwctl.runtime.engine.engine import Engine, open_pack
    from pwctl.text import spread_windows

    if method not in METHODS:
        raise PwctlError(f"--method {method}: use one of {', '.join(METHODS)}")
    data = data or [CALIB_SAMPLE]
    missing = [str(f) for f in data if not f.is_file()]
    if missing:
        raise PwctlError(f"--data {', '.join(missing)}: no such file")
    opened = open_pack(pack)
    checks.between("--seq-len", seq_len, 2, checks.model_context(opened.manifest.config))
    engine = Engine(opened, device, experts="store")  # per-block width sweeps
    ids = spread_windows(engine.tokenizer, data, samples, seq_len)
    columns = (TextColumn("profiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("blocks", total=len(engine.pack.blocks))
        prof = run_profile(engine, ids, method, lambda n, t: bar.update(task, completed=n))
    prof.meta["data"] = [p.name for p in data]
    prof.save(engine.pack)
    widths = prof.widths
    rows = [
        (f"{w}", float(prof.damage[:, i].mean()), float(prof.damage[:, i].max()))
        for i, w in enumerate(widths)
    ]
    print_table(
        f"damage per token ({method}, {prof.meta['tokens']} tokens, {prof.meta['seconds']:.1f} s)",
        ("width", "mean over blocks", "max"),
        rows,
    )
    if "spearman_proxy_vs_measured" in prof.meta:
        sp = prof.meta["spearman_proxy_vs_measured"]
        console.print(
            f"proxy vs measured Spearman: overall {sp['overall']:.3f}, "
            f"within width {sp['within_width_mean']:.3f}"
        )
    share = prof.router_share
    ratios = [
        f"{r.max() / r.min():.1f}" if r.min() > 0 else f"inf ({int((r == 0).sum())} unused)"
        for r in share
    ]
    console.print(f"router load, max/min expert share per layer: {', '.join(ratios)}")
    write_json(
        json,
        {k: v for k, v in prof.meta.items() if k not in ("bytes", "blocks")}
        | {
            "damage_mean_by_width": dict(
                zip(map(str, widths), prof.damage.mean(0).tolist(), strict=True)
            ),
            "router_share": share.tolist(),
        },
    )
