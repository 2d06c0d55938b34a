"""pwctl profile: not built yet (profile and fit-residual issue)."""

from __future__ import annotations

from typing import Annotated

import typer

from pwctl.commands.common import not_built


def run(pack: Annotated[str, typer.Argument(help="pack folder")]) -> None:
    """Not built yet: lands with the profile and fit-residual issue."""
    not_built("profile", "profile and fit-residual issue")
