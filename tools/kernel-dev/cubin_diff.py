"""Which kernels' machine code differs between two builds of the kernels (nvcc or NVRTC cubins).

Whole cubins differ in their notes even when no kernel does, and the dev machine has no
cuobjdump; this compares each kernel's `.text.<name>` section of the two ELF files byte for byte.
Either build may be several cubins, e.g. the runtime's parts (`registry.PARTS`, each built from
`build.part_source`), whose kernels are then taken together: the first build's joined by
commas, the second's as the arguments after it.
Usage:
  python3 tools/kernel-dev/cubin_diff.py a.cubin[,a2.cubin ...] b.cubin [b2.cubin ...] [--all]"""

from __future__ import annotations

import struct
import sys
from pathlib import Path


def sections(path: Path) -> dict[str, bytes]:
    """Every section of an ELF64 file by name (little-endian, as nvcc writes cubins)."""
    b = path.read_bytes()
    if b[:4] != b"\x7fELF" or b[4] != 2:
        raise SystemExit(f"{path}: not an ELF64 file")
    shoff = struct.unpack_from("<Q", b, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", b, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * entsize) for i in range(count)]
    names = heads[names_at][4]
    out = {}
    for name_off, _, _, _, off, size, *_ in heads:
        end = b.index(b"\0", names + name_off)
        out[b[names + name_off : end].decode()] = b[off : off + size]
    return out


def kernel_texts(paths: list[str]) -> dict[str, bytes]:
    """The `.text.<kernel>` sections of one build's cubins, taken together."""
    texts = {}
    for p in paths:
        texts.update((n, t) for n, t in sections(Path(p)).items() if n.startswith(".text."))
    return texts


def main() -> None:
    paths = [p for p in sys.argv[1:] if p != "--all"]
    a, b = kernel_texts(paths[0].split(",")), kernel_texts(paths[1:])
    show_all = "--all" in sys.argv[1:]
    kernels = sorted(n for n in set(a) | set(b) if n.startswith(".text."))
    for n in kernels:
        same = a.get(n) == b.get(n)
        if show_all or not same:
            print("same" if same else "DIFF", n[6:], len(a.get(n, b"")), len(b.get(n, b"")))
    print(f"{sum(a.get(n) != b.get(n) for n in kernels)} of {len(kernels)} kernels differ")


if __name__ == "__main__":
    main()
