"""A rank that `serve --expert-parallel N` started (launch.ranks sets RANK and WORLD_SIZE):
python -m pwctl.commands.serve_rank OPTIONS, OPTIONS being rank 0's options of serve as JSON. It
runs serve's own `run` with them: the same engine, serving the requests rank 0 gives it (no HTTP
front end of its own)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from pwctl.commands import serve
from pwctl.commands.common import console


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m {serve.RANK_MODULE} OPTIONS_JSON (launch.ranks starts it)")
        return 2
    options = json.loads(argv[0])
    console.quiet = True  # rank 0 prints for all
    try:
        serve.run(**{**options, "pack": Path(options["pack"])})
    except typer.Exit as e:  # run's errors: printed already, exit 2
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
