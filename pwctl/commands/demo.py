"""pwctl demo: the whole pipeline on the bundled model, on the CPU."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from pwctl import tiny
from pwctl.bench.ppl import run_ppl, token_windows
from pwctl.checkpoint import MODELS_DIR, bundled_models
from pwctl.commands.common import console, handles_errors, print_table, write_json
from pwctl.convert import ConvertOptions, convert
from pwctl.policy import parse_policy
from pwctl.runtime.engine import Engine, open_pack

POLICIES = ["fp16", "uniform:8", "uniform:6", "uniform:4", "uniform:3", "uniform:2"]
EVAL_SAMPLE = MODELS_DIR / "samples" / "eval.txt"
CALIB_SAMPLE = MODELS_DIR / "samples" / "calib.txt"


@handles_errors
def run(
    model: Annotated[str, typer.Option(help="bundled model name or checkpoint")] = "tiny-mixtral",
    workdir: Annotated[Path | None, typer.Option(help="keep the pack here")] = None,
    max_tokens: Annotated[int, typer.Option(help="eval tokens")] = 4096,
    json: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """convert -> bench --ppl on a bundled model: quality vs memory per policy."""
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
    console.print(f"[bold]1/2 convert[/] {src} -> {work / 'pack'} (calib: {calib})")
    report = convert(src, work / "pack", ConvertOptions(calib=calib, force=True))
    console.print(f"    {report.blocks} blocks in {report.seconds:.1f} s")
    console.print("[bold]2/2 bench --ppl[/] (profile and fit-residual land with their issue)")
    engine = Engine(open_pack(work / "pack"))
    data = EVAL_SAMPLE if EVAL_SAMPLE.is_file() else Path(tiny.__file__)
    results = run_ppl(
        engine, token_windows(engine, data, 256, max_tokens), [parse_policy(p) for p in POLICIES]
    )
    print_table(
        f"quality vs memory ({data.name}, {results[0].tokens} tokens)",
        ("policy", "expert MB", "bits/weight", "ppl", "KL nats/tok"),
        [(r.policy, r.expert_mb, r.bits_per_weight, r.ppl, r.kl) for r in results],
    )
    write_json(json, [r.as_dict() for r in results])
