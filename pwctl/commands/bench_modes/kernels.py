"""bench --kernels: the fused MoE layer's kernels on synthetic paged layers (GPU), rows streamed
as they come, then against the kernel targets."""

from __future__ import annotations

from pathlib import Path

from pwctl.commands.common import console, err_console, print_table, write_json
from pwctl.errors import PwctlError


def run(
    shape: list[str] | None, width: list[str] | None, tokens: list[int] | None, json: Path | None
) -> None:
    import torch

    from pwctl.bench import kernels as kb

    shapes, widths = shape or list(kb.SHAPES), width or ["2", "3", "4", "8", "mixed"]
    counts = tokens or [1, 2, 4, 8, 16, 512]
    kb.check_args(shapes, widths, counts)
    if not torch.cuda.is_available():
        raise PwctlError("bench --kernels needs a CUDA device")
    copy_bw, rows = kb.run_kernel_bench(
        shapes, widths, counts,
        on_row=lambda r: err_console.print("  ".join(kb.row_cells(r)), highlight=False),
    )  # fmt: skip
    name = torch.cuda.get_device_name()
    title = f"fused MoE layer, {name} (copy {copy_bw / 1e12:.2f} TB/s)"
    print_table(title, kb.ROW_COLUMNS, [kb.row_cells(r) for r in rows])
    against = kb.against_targets(rows)
    if against:
        print_table(
            "against the kernel targets (worst of the rows each covers)",
            kb.TARGET_COLUMNS,
            [kb.target_cells(c) for c in against],
        )
    else:  # e.g. only widths 5-8: say so rather than print an empty table
        names = "; ".join(t.name for t in kb.TARGETS)
        console.print(f"no kernel target covers these rows (targets: {names})")
    write_json(json, {"device": name, "copy_bytes_per_s": copy_bw,
                      "rows": [r.as_dict() for r in rows], "targets": against})  # fmt: skip
