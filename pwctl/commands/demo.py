"""pwctl demo: the whole pipeline on the bundled model, on the CPU."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from pwctl.commands import checks
from pwctl.commands.common import console, handles_errors, print_ppl, write_json
from pwctl.errors import PwctlError
from pwctl.policy import parse_policy

POLICIES = [
    "fp16",
    "uniform:8",
    "uniform:6",
    "uniform:4",
    "uniform:3",
    "uniform:2",
    "static:0.2",
    "pagedweight:0.2",
    "static:0.35",
    "pagedweight:0.35",
]


@handles_errors
def run(
    model: Annotated[str, typer.Option(help="bundled model name or checkpoint")] = "tiny-mixtral",
    workdir: Annotated[Path | None, typer.Option(help="keep the pack here")] = None,
    max_tokens: Annotated[int, typer.Option(help="eval tokens")] = 4096,
    json: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """convert -> profile -> fit-residual -> bench --ppl: quality vs memory per policy."""
    checks.at_least("--max-tokens", max_tokens, 256)  # one eval window of 256 tokens
    if workdir is not None and workdir.exists() and not workdir.is_dir():
        raise PwctlError(f"--workdir {workdir}: not a folder")
    from pwctl.bench.ppl import run_ppl
    from pwctl.build import tiny
    from pwctl.build.checkpoint import CALIB_SAMPLE, EVAL_SAMPLE, bundled_models
    from pwctl.build.convert import ConvertOptions, convert
    from pwctl.build.profile import run_profile
    from pwctl.build.residual import fit
    from pwctl.runtime.engine.engine import Engine, open_pack
    from pwctl.text import spread_windows, token_windows

    work = workdir or Path(tempfile.mkdtemp(prefix="pwctl-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    src: str | Path = model
    if model not in bundled_models() and not Path(model).is_dir():
        console.print(
            f"[yellow]{model} is not bundled yet[/]: using a random tiny Mixtral "
            "(quality numbers are then meaningless)"
        )
        src = tiny.make_checkpoint("mixtral", work / "src", hidden=128, layers=2, experts=8)
    calib = CALIB_SAMPLE if CALIB_SAMPLE.is_file() else None
    console.print(f"[bold]1/4 convert[/] {src} -> {work / 'pack'} (calib: {calib})")
    report = convert(src, work / "pack", ConvertOptions(calib=calib, force=True))
    console.print(f"    {report.blocks} blocks in {report.seconds:.1f} s")
    engine = Engine(open_pack(work / "pack"))
    console.print("[bold]2/4 profile[/] (measured KL per block and width)")
    prof_data = [calib] if calib else [Path(tiny.__file__)]
    prof = run_profile(engine, spread_windows(engine.tokenizer, prof_data, 16, 128), "measured")
    prof.meta["data"] = [p.name for p in prof_data]
    prof.save(engine.pack)
    sp = prof.meta["spearman_proxy_vs_measured"]
    console.print(
        f"    {prof.meta['seconds']:.1f} s; proxy vs measured Spearman {sp['overall']:.3f}"
    )
    console.print("[bold]3/4 fit-residual[/]")
    residual = fit(engine.pack)
    residual.save(engine.pack)
    use = "used by pagedweight" if residual.usable else "below 0.1: pagedweight ignores it"
    console.print(f"    held-out R^2 {residual.metrics['r2_test']:.3f} ({use})")
    console.print("[bold]4/4 bench --ppl[/] (uniform widths vs budgets planned from the profile)")
    data = EVAL_SAMPLE if EVAL_SAMPLE.is_file() else Path(tiny.__file__)
    results = run_ppl(
        engine,
        token_windows(engine.tokenizer, data, 256, max_tokens),
        [parse_policy(p) for p in POLICIES],
    )
    print_ppl(f"quality vs memory ({data.name}, {results[0].tokens} tokens)", results)
    write_json(json, [r.as_dict() for r in results])
