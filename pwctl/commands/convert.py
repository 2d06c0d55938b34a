"""pwctl convert SRC OUT: an HF MoE checkpoint -> a nested bit-plane pack."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pwctl.commands.common import console, handles_errors, print_table, write_json
from pwctl.device import CHOICES

TERMINATED = 128 + signal.SIGTERM  # the shell's exit status of a process ended by SIGTERM


@handles_errors
def run(
    src: Annotated[str, typer.Argument(help="checkpoint folder or bundled model name")],
    out: Annotated[Path, typer.Argument(help="pack folder to create")],
    min_bits: Annotated[int, typer.Option(help="lowest width kept")] = 2,
    max_bits: Annotated[int, typer.Option(help="parent width (planes stored)")] = 8,
    device: Annotated[str, typer.Option(help=f"{CHOICES} (runs the k-means)")] = "cpu",
    calib: Annotated[
        Path | None, typer.Option(help="text file: weight the k-means by E(x^2)")
    ] = None,
    calib_tokens: Annotated[int, typer.Option(help="calibration tokens used")] = 16384,
    table_group: Annotated[int, typer.Option(help="min weights per table (rows share)")] = 1024,
    reference: Annotated[bool, typer.Option(help="keep original expert weights (fp16)")] = True,
    force: Annotated[bool, typer.Option(help="replace OUT if it exists")] = False,
    json: Annotated[Path | None, typer.Option("--json", help="write the report here")] = None,
) -> None:
    """Quantize every expert block into nested bit-planes (first b planes = b-bit weights)."""
    from pwctl.build.convert import ConvertOptions, convert

    opts = ConvertOptions(
        min_bits=min_bits,
        max_bits=max_bits,
        device=device,
        calib=calib,
        calib_tokens=calib_tokens,
        force=force,
        reference=reference,
        table_group=table_group,
    )
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with terminate_like_interrupt(), Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("quantizing", total=None)
        report = convert(
            src,
            out,
            opts,
            lambda n, total, name: bar.update(task, completed=n, total=total, description=name),
        )
    rows = [
        ("pack", str(report.pack)),
        ("architecture", report.model_type),
        ("MoE layers", report.layers),
        ("blocks", report.blocks),
        ("weighting", report.weighting),
        ("seconds", report.seconds),
        ("expert MB read", report.expert_bytes_in / 1e6),
        ("MB/s", report.mb_per_s),
        ("pack MB", report.pack_bytes / 1e6),
        ("peak RSS MB", report.peak_rss_mb),
    ]
    print_table("pwctl convert", ("field", "value"), rows)
    write_json(json, {k: v for k, v in rows} | {"mb_per_s": report.mb_per_s})


@contextmanager
def terminate_like_interrupt() -> Iterator[None]:
    """SIGTERM unwinds the stack as Ctrl-C does (SystemExit with status 143, not an instant
    death), so convert's cleanup removes the temporary pack folder on either signal."""

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(TERMINATED)

    previous = signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C as KeyboardInterrupt even where the parent left SIGINT ignored (a pytest-xdist
    # worker, a shell's background job): the same cleanup either way
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
