"""Which kernels' machine code differs between two builds of the kernels (nvcc or NVRTC cubins).

Whole cubins differ in their notes even when no kernel does, and the dev machine has no
cuobjdump; this compares each kernel's `.text.<name>` section of the two ELF files byte for byte,
and its resources: registers, frame and stack sizes (the `.nv.info` attributes) and static shared
memory (`.nv.shared.<name>`'s size), which set its occupancy.
Either build may be several cubins, e.g. the runtime's parts (`registry.PARTS`, each built from
`build.part_source`), whose kernels are then taken together: the first build's joined by
commas, the second's as the arguments after it.
Usage:
  python3 tools/kernel-dev/cubin_diff.py a.cubin[,a2.cubin ...] b.cubin [b2.cubin ...] [--all]"""

from __future__ import annotations

import struct
import sys
from pathlib import Path


def headers(path: Path) -> tuple[bytes, dict[str, tuple]]:
    """An ELF64 file's bytes and its section headers by name (little-endian, as nvcc writes
    cubins): (name, type, flags, addr, offset, size, link, info, align, entsize)."""
    b = path.read_bytes()
    if b[:4] != b"\x7fELF" or b[4] != 2:
        raise SystemExit(f"{path}: not an ELF64 file")
    shoff = struct.unpack_from("<Q", b, 0x28)[0]
    entsize, count, names_at = struct.unpack_from("<HHH", b, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * entsize) for i in range(count)]
    names = heads[names_at][4]
    return b, {b[names + h[0] : b.index(b"\0", names + h[0])].decode(): h for h in heads}


def sections(path: Path) -> dict[str, bytes]:
    """Every section of an ELF64 file by name."""
    b, heads = headers(path)
    return {name: b[h[4] : h[4] + h[5]] for name, h in heads.items()}


def kernel_texts(paths: list[str]) -> dict[str, bytes]:
    """The `.text.<kernel>` sections of one build's cubins, taken together."""
    texts = {}
    for p in paths:
        texts.update((n, t) for n, t in sections(Path(p)).items() if n.startswith(".text."))
    return texts


# `.nv.info` attributes of a function, each (symbol index, value): EIATTR_REGCOUNT, FRAME_SIZE,
# MIN_STACK_SIZE, MAX_STACK_SIZE
RESOURCES = {0x2F: "registers", 0x11: "frame", 0x12: "min stack", 0x23: "max stack"}


def kernel_resources(paths: list[str]) -> dict[str, dict[str, int]]:
    """Each kernel's RESOURCES and static shared memory, of one build's cubins taken together.
    A `.text.<kernel>` header's info holds its symbol's index, which the attributes name."""
    out: dict[str, dict[str, int]] = {}
    for p in paths:
        b, heads = headers(Path(p))
        names = {h[7] & 0xFFFFFF: n[6:] for n, h in heads.items() if n.startswith(".text.")}
        for name in names.values():
            shared = heads.get(f".nv.shared.{name}")
            out[f".text.{name}"] = {"shared": shared[5] if shared else 0}
        info = heads[".nv.info"]
        blob, i = b[info[4] : info[4] + info[5]], 0
        while i + 4 <= len(blob):  # records: format, attribute, u16 (a value, or a size)
            fmt, attr, n = blob[i], blob[i + 1], struct.unpack_from("<H", blob, i + 2)[0]
            i += 4
            if fmt == 4 and attr in RESOURCES and n == 8:
                sym, value = struct.unpack_from("<II", blob, i)
                if sym in names:
                    out[f".text.{names[sym]}"][RESOURCES[attr]] = value
            i += n if fmt == 4 else 0
    return out


def main() -> None:
    paths = [p for p in sys.argv[1:] if p != "--all"]
    first, second = paths[0].split(","), paths[1:]
    a, b = kernel_texts(first), kernel_texts(second)
    ra, rb = kernel_resources(first), kernel_resources(second)
    show_all = "--all" in sys.argv[1:]
    kernels = sorted(n for n in set(a) | set(b) if n.startswith(".text."))
    for n in kernels:
        same = a.get(n) == b.get(n)
        uses = "" if ra.get(n) == rb.get(n) else f"  resources {ra.get(n)} -> {rb.get(n)}"
        if show_all or not same or uses:
            print("same" if same else "DIFF", n[6:], len(a.get(n, b"")), len(b.get(n, b"")), uses)
    print(f"{sum(a.get(n) != b.get(n) for n in kernels)} of {len(kernels)} kernels' code differ, "
          f"{sum(ra.get(n) != rb.get(n) for n in kernels)} their resources")  # fmt: skip


if __name__ == "__main__":
    main()
