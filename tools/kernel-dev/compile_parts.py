"""How long NVRTC takes over the kernels' programs on this machine, through CuPy as the runtime
compiles them (`build.modules`), with CuPy's disk cache pointed at an empty folder so that
nothing is found there. `parts`: the runtime's parts (`registry.PARTS`); `kernels`: every kernel
a program of its own, to choose the parts by (pwctl/kernels/registry.py). Programs build side by
side, a thread a core.

Usage (device tool): python3 tools/kernel-dev/compile_parts.py [parts|kernels] [threads]
Prints each program's seconds (its own compile, from submission when threads >= programs) and the
wall time of the whole."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="pwctl-nvrtc-")  # before CuPy reads it

import cupy  # noqa: E402

from pwctl.kernels import build, registry  # noqa: E402


def programs(mode: str) -> list[tuple[str, str]]:
    """(label, program) of each program `mode` builds."""
    if mode == "parts":
        return [(f"part {k}: {' '.join(names)}", build.part_source(k))
                for k, names in enumerate(registry.PARTS)]  # fmt: skip
    return [(name, build.program_source([name])) for name in registry.BY_NAME]


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "parts"
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else os.cpu_count() or 1
    arch = build.device_arch()
    options = build.program_options(arch)

    def compile_one(program: tuple[str, str]) -> tuple[str, float]:
        label, code = program
        t0 = time.perf_counter()
        mod = cupy.RawModule(code=code, options=options)
        mod.compile()
        return label, time.perf_counter() - t0

    todo = programs(mode)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(threads, len(todo))) as pool:
        done = list(pool.map(compile_one, todo))
    wall = time.perf_counter() - t0
    for label, seconds in sorted(done, key=lambda d: -d[1]):
        print(f"{seconds:7.1f} s  {label}")
    total = sum(seconds for _, seconds in done)
    print(f"{mode}: {len(todo)} programs on {min(threads, len(todo))} threads ({arch}), "
          f"wall {wall:.1f} s, sum {total:.1f} s, cores {os.cpu_count()}")  # fmt: skip


if __name__ == "__main__":
    main()
