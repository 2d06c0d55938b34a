"""bench --results: regenerate docs/RESULTS.md and results.png (both tiny models, every policy)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pwctl.commands.common import console


def run(max_tokens: int) -> None:
    from pwctl.bench.results import run_results

    out = Path("docs") if Path("docs").is_dir() else Path(".")
    run_results(["tiny-mixtral", "tiny-qwen-moe"], Path(tempfile.mkdtemp()), out, max_tokens)
    console.print(f"wrote {out / 'RESULTS.md'} and {out / 'results.png'}")
