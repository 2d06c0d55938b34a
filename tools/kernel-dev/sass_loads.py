"""Global loads that wait on each other, per kernel of a cubin: a load whose destination register
the next load reuses was issued after the first one returned (the compiler had to keep them
apart: a load behind a branch, a loop-carried sum). It found 8 such loads in a row in
`popc_planes` (3 us of its 4.3) and a chain in `popc_fold` (docs/decisions/023-popc-pieces.md).
Needs `cuobjdump` (the `nvidia-cuda-cuobjdump` wheel, docs/KERNELS.md).
Usage: python3 tools/kernel-dev/sass_loads.py x.cubin [KERNEL]   (KERNEL: list its pairs)"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

LOAD = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\d+\s+)?(LDG\S*)\s+(R\d+),\s*(.*?)\s*;")


def loads(cubin: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """(offset, opcode, destination, address) of every LDG, by kernel."""
    tool = os.environ.get("CUOBJDUMP", "cuobjdump")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True)
    out: dict[str, list] = {}
    kernel = None
    for line in sass.stdout.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            kernel = out.setdefault(m.group(1), [])
            continue
        if kernel is not None and (m := LOAD.search(line)):
            kernel.append(m.groups())
    return out


def main() -> None:
    by_kernel = loads(sys.argv[1])
    if len(sys.argv) > 2:
        ls = by_kernel[sys.argv[2]]
        for a, b in itertools.pairwise(ls):
            if a[2] == b[2]:
                print(f"{a[0]} {a[1]} {a[2]} [{a[3]}] -> {b[0]} {b[1]} [{b[3]}]")
        return
    for name, ls in sorted(by_kernel.items()):
        pairs = sum(a[2] == b[2] for a, b in itertools.pairwise(ls))
        print(f"{name}: {len(ls)} loads, {pairs} reusing the last one's register")


if __name__ == "__main__":
    main()
