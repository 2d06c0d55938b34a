"""What every command shares: the console, error handling, tables and --json output.

Command modules import only typer, rich and light pwctl modules at the top: `pwctl --help` and
argument errors must not wait for torch or transformers, which each command imports in its body."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pwctl.device import CHOICES
from pwctl.errors import PwctlError
from pwctl.policy import AUTO, Policy, parse_policy

# The options generate, serve and bench share, declared once (each command gives the default).
POLICY_HELP = "auto (pagedweight with a profile, else uniform; at most 4 bits), fp16, uniform:B or a budgeted policy"  # noqa: E501
PolicyOption = Annotated[str, typer.Option("--policy", help=POLICY_HELP)]
# bench: several policies, one row each
Policies = Annotated[list[str] | None, typer.Option("--policy", help=f"repeatable: {POLICY_HELP}")]
MemoryBudget = Annotated[
    str | None,
    typer.Option(help="planes + KV + workspace: a size (12GiB) or a fraction of free memory"),
]
MaxBits = Annotated[
    int | None,
    typer.Option(help="widest width served (default: the pack's); narrower decodes faster"),
]
Device = Annotated[str, typer.Option(help=CHOICES)]
# serve, generate and bench --throughput: how decode steps launch on CUDA
CudaGraphs = Annotated[
    bool,
    typer.Option("--cuda-graphs/--eager", help="decode steps replayed from CUDA graphs (CUDA)"),
]
JsonOut = Annotated[Path | None, typer.Option("--json", help="write the results here")]


def policy_or_auto(text: str) -> Policy | None:
    """--policy: None for `auto` (the engine chooses once the pack is loaded)."""
    return None if text.strip().lower() == AUTO else parse_policy(text)


# piped output (logs, CI) gets room for the wide tables instead of rich's 80-column default
console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


def handles_errors(fn: Callable) -> Callable:
    """PwctlError -> one red line on stderr and exit code 2, no traceback (a message that
    quotes user input with line breaks in it is joined into that one line)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PwctlError as e:
            # escaped: a message's brackets ("pip install 'pwctl[plot]'", paths) are not markup
            line = " ".join(str(e).splitlines())
            err_console.print(f"[red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def not_built(command: str, issue: str) -> None:
    err_console.print(f"[yellow]pwctl {command} is not built yet[/] ({issue}).")
    raise typer.Exit(3)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for c in columns:
        first = c == columns[0]
        table.add_column(c, justify="left" if first else "right", no_wrap=first)
    for r in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r])
    console.print(table)


def write_json(path: Path | None, obj: Any) -> None:
    if path is not None:
        from pwctl.format.pack import write_atomic  # imports torch: not at CLI start

        write_atomic(path, (json.dumps(obj, indent=2, default=str) + "\n").encode())
        console.print(f"wrote {path}")


def print_ppl(title: str, results: Sequence[Any]) -> None:
    """The quality-vs-memory table of `bench --ppl` and `demo`."""
    columns = ("policy", "MB", "bits/w", "ppl", "KL/tok", "KL 95%", "MoE err")
    rows = [
        (
            r.policy,
            f"{r.expert_mb:.3f}",
            f"{r.bits_per_weight:.2f}",
            f"{r.ppl:.2f}",
            f"{r.kl:.3g}",
            f"±{(r.kl_ci[1] - r.kl_ci[0]) / 2:.1g}",
            f"{r.moe_err:.2g}",
        )
        for r in results
    ]
    print_table(title, columns, rows)
