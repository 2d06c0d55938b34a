"""The pwctl command line: one thin module per subcommand in pwctl/commands/."""

from __future__ import annotations

import os

# No downloads at run time: models, tokenizers and data come from local paths.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from typing import Annotated  # noqa: E402

import typer  # noqa: E402

# light modules only: each command imports torch / transformers in its body (commands/common.py)
from pwctl import __version__  # noqa: E402
from pwctl.commands import bench, convert, demo, fit_residual, generate, profile, serve  # noqa: E402

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    help="Serve MoE models with expert precision paged at run time.",
)


def version() -> str:
    return __version__


def _print_version(show: bool) -> None:
    if show:
        typer.echo(f"pwctl {version()}")
        raise typer.Exit()


@app.callback()
def main(
    _version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """Serve MoE models with expert precision paged at run time."""


app.command("convert")(convert.run)
app.command("profile")(profile.run)
app.command("fit-residual")(fit_residual.run)
app.command("generate")(generate.run)
app.command("bench")(bench.run)
app.command("serve")(serve.run)
app.command("demo")(demo.run)

if __name__ == "__main__":
    app()
