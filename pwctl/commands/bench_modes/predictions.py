"""bench --predictions FILE: score LongBench predictions (jsonl, or a folder in LongBench's
layout) with LongBench's own scorer; no pack."""

from __future__ import annotations

from pathlib import Path

from pwctl.commands.common import print_table, write_json


def run(predictions: Path, json: Path | None) -> None:
    from pwctl.bench import longbench as lb

    results = lb.run_predictions(predictions)
    print_table(f"LongBench scores of {predictions.name}", *lb.table(results))
    write_json(json, {"predictions": str(predictions), "results": [r.as_dict() for r in results]})
