"""bench --quantizer: the nested quantizer against RTN g128 on Student-t(5) weights."""

from __future__ import annotations

from pathlib import Path

from pwctl.commands import checks
from pwctl.commands.common import print_table, write_json
from pwctl.device import parse_device
from pwctl.errors import PwctlError


def run(rows: int, cols: int, device: str, json: Path | None) -> None:
    device = parse_device(device)
    from pwctl.bench.quantizer import GROUP, as_dicts, run_quantizer_bench

    checks.at_least("--rows", rows, 1)
    if cols < GROUP or cols % GROUP:
        raise PwctlError(f"--cols {cols}: a multiple of {GROUP} (the RTN baseline's group)")
    results = run_quantizer_bench(rows, cols, device=device)
    print_table(
        f"quantizer on Student-t(5) weights {rows}x{cols}",
        ("scheme", "bits", "bits/weight", "weight MSE", "output err"),
        [(r.scheme, r.bits, r.bits_per_weight, r.weight_mse, r.output_err) for r in results],
    )
    write_json(json, {"rows": rows, "cols": cols, "device": device, "results": as_dicts(results)})
