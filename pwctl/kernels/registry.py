"""Every kernel, one row each: the family file that holds its code, the part (program) it compiles
in and, for the decode kernels made from a template, its entry. The parts `build` compiles, the
entries it writes and the names the tests look for in the cubins all come from `KERNELS`.

Parts: NVRTC spends nearly all its time in NVVM's optimizer on each kernel's own inlined body, one
core a program, so a family's kernels are grouped by their compile times into parts that build
side by side, none much longer than the slowest kernel, `gate_up_n8`, alone; the longest come
first, so that a machine of fewer cores starts them first (docs/decisions/032-nvrtc-parts.md).
A part holds kernels of one family, so that a change to one family's file leaves the others'
programs, and their cached builds, as they were."""

from __future__ import annotations

from dataclasses import dataclass

from pwctl.kernels.geometry import POPC_MAX_BITS

# The family files (cuda/<family>.cu), in the order a program of several includes them.
FAMILIES = ("lookup", "popc", "prefill", "prefill_wg", "prep", "route")


@dataclass(frozen=True)
class Kernel:
    """A kernel: `family` names the file that holds its code, `part` the program it compiles in.
    A decode kernel is made by its family's entry macro (`entry`: GATE_UP_ENTRY or DOWN_ENTRY)
    from a device template (`body`) with launch bounds (`bounds`); any other is written out in
    its family file under `#if WANT(name)`."""

    name: str
    family: str
    part: int
    entry: str = ""
    bounds: str = ""
    body: str = ""

    def entry_line(self) -> str:
        """The line of the program that makes the kernel (entries only)."""
        return f"{self.entry}({self.name}, __launch_bounds__({self.bounds}), {self.body})"


def _decode(name: str, family: str, part: int, ctas: str, body: str) -> Kernel:
    """A decode kernel: 32 * WARPS threads, at least `ctas` CTAs an SM (none: "")."""
    entry = "GATE_UP_ENTRY" if name.startswith("gate_up_") else "DOWN_ENTRY"
    return Kernel(name, family, part, entry, "32 * WARPS" + (f", {ctas}" if ctas else ""), body)


def _lookup(name: str, part: int, ctas: str) -> Kernel:
    """A lookup decode kernel of NT n-tiles of 8 tokens a CTA (its name's n<NT>)."""
    nt = int(name.rsplit("_n", 1)[1])
    return _decode(name, "lookup", part, ctas, f"{name.rsplit('_', 1)[0]}<{nt}>")


def _popc(name: str, part: int, ctas: str, bits: int, few: bool) -> Kernel:
    """A popc decode kernel: its binary mma reads blocks up to `bits` wide; `few`: calls of
    several tokens (the lookup takes their slots of more than one)."""
    template = "gate_up_popc" if name.startswith("gate_up_") else "down_popc"
    return _decode(name, "popc", part, ctas, f"({template}<{bits}, {str(few).lower()}>)")


# Launch bounds of the lookup decode (what each measured fastest with on the H200,
# decisions/031): one n-tile, no CTA floor (80 / 72 registers; a floor of 7, i.e. 72 registers
# for gate_up_n1, ran 5-9% slower at 1-4 tokens); wider, a floor that leaves their registers as
# they were (96 / 128) but ran 3-9% faster at 16 tokens than none.
# The popc builds (128 registers): `p1b3` up to 3 bits, 2 registers a subset (popc_regs), 80
# registers, 6 CTAs an SM (decisions/021; with 4 a subset: 96 registers and 5 CTAs, and at 6 it
# spilled and was slower on Mixtral); `pn`, `pnb3` for calls of 2..POPC_MAX_TOKENS tokens, one-token
# slots on the binary mma, the others the lookup; `p1b5`: P1B5_CTAS (popc.cu).
KERNELS = (
    _lookup("gate_up_n8", 0, "4"),
    _popc("gate_up_pn", 1, "4", POPC_MAX_BITS, True),
    Kernel("popc_planes", "popc", 1),
    _lookup("down_n8", 2, "4"),
    _lookup("gate_up_n2", 2, "5"),
    _lookup("gate_up_n4", 3, "5"),
    _lookup("down_n4", 3, "5"),
    _popc("gate_up_p1", 4, "4", POPC_MAX_BITS, False),
    _popc("gate_up_p1b3", 4, "6", 3, False),
    _popc("gate_up_pnb3", 5, "5", 3, True),
    _popc("down_pn", 5, "4", POPC_MAX_BITS, True),
    _popc("down_pnb3", 5, "5", 3, True),
    _popc("down_p1", 5, "4", POPC_MAX_BITS, False),
    _popc("down_p1b3", 5, "6", 3, False),
    Kernel("gate_up_prefill_wg", "prefill_wg", 6),
    Kernel("down_prefill_wg", "prefill_wg", 6),
    Kernel("token_tiles", "prefill_wg", 6),
    _popc("gate_up_p1b5", 7, "P1B5_CTAS", 5, False),
    _popc("down_p1b5", 7, "P1B5_CTAS", 5, False),
    Kernel("gate_up_prefill", "prefill", 8),
    Kernel("down_prefill", "prefill", 8),
    _lookup("gate_up_n1", 9, ""),
    _lookup("down_n1", 9, ""),
    _lookup("down_n2", 9, "5"),
    Kernel("decode_prep", "prep", 10),
    Kernel("prefill_prep", "prep", 10),
    Kernel("route_prep", "route", 11),
)

BY_NAME = {k.name: k for k in KERNELS}
PARTS = tuple(
    tuple(k.name for k in KERNELS if k.part == part)
    for part in range(1 + max(k.part for k in KERNELS))
)
PART_OF = {k.name: k.part for k in KERNELS}


def part_family(part: int) -> str:
    """The family of part `part`'s kernels (a part holds one family's)."""
    (family,) = {BY_NAME[name].family for name in PARTS[part]}
    return family
