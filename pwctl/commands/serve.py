"""pwctl serve: not built yet (serving engine issue)."""

from __future__ import annotations

from typing import Annotated

import typer

from pwctl.commands.common import not_built


def run(pack: Annotated[str, typer.Argument(help="pack folder")]) -> None:
    """Not built yet: lands with the serving engine issue."""
    not_built("serve", "serving engine issue")
