"""A rank that `bench --throughput --expert-parallel N` started (launch.ranks sets RANK and
WORLD_SIZE): python -m pwctl.commands.bench_modes.throughput_rank OPTIONS, OPTIONS being rank
0's options of the mode as JSON (`throughput.encode`). It runs the mode's own `run` with them,
so it serves its share of every run in step with the others; only rank 0 prints and writes
files."""

from __future__ import annotations

from pwctl.commands.bench_modes import throughput
from pwctl.errors import PwctlError
from pwctl.runtime.parallel.launch import rank_entry


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise PwctlError(f"usage: python -m {throughput.RANK_MODULE} OPTIONS_JSON (launch.ranks "
                         "starts it)")  # fmt: skip
    throughput.run(**throughput.decode(argv[0]))
    return 0


if __name__ == "__main__":
    rank_entry(main)
