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

from dataclasses import dataclass, replace

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


# ---- variants: what a model's experts and router ask of the kernels ----------------------------
# The gated activations the GEMM families compile (cuda/planes.cuh `glu`), by the name of their
# `GLU_*` macro; the recipe's activation names (format/recipe.py MoESpec.act) map to them.
GLUS = {"silu": "GLU_SILU", "gelu_tanh": "GLU_GELU_TANH", "clamped_swiglu": "GLU_CLAMPED_SWIGLU"}
_GLU_OF_ACT = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "clamped_swiglu": "clamped_swiglu",
}
# What each family's code reads of a variant (a field of `Variant`): a part is compiled again for a
# variant only where its family reads a field that differs from the default's.
_GEMM = ("glu", "swiglu_alpha", "swiglu_limit", "expert_bias")
READS = {
    "lookup": _GEMM,
    "popc": _GEMM,
    "prefill": _GEMM,
    "prefill_wg": _GEMM,
    "prep": (),
    "route": ("router_bias",),
}


@dataclass(frozen=True)
class Variant:
    """What a program compiles besides its kernels: the experts' gated activation (`glu`, a key
    of GLUS; GPT-OSS's alpha and limit are compile-time constants, cuda/planes.cuh says why),
    whether the routed experts have gate / up / down biases and whether the router has one.
    The default is the build every kernel had before variants: its programs are unchanged."""

    glu: str = "silu"
    expert_bias: bool = False
    router_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.glu not in GLUS:
            raise ValueError(f"no kernels for activation {self.glu!r}; they compile {list(GLUS)}")

    @property
    def name(self) -> str:
        """What differs from the default: '' for it, else e.g. 'gelu_tanh', 'router_bias' or
        'clamped_swiglu(1.702,7.0)+expert_bias+router_bias' (`unqualified` reads it back)."""
        glu = [] if self.glu == DEFAULT.glu else [self.glu]
        if self.glu == "clamped_swiglu":
            glu = [f"{self.glu}({self.swiglu_alpha!r},{self.swiglu_limit!r})"]
        flags = [f for f in ("expert_bias", "router_bias") if getattr(self, f)]
        return "+".join(glu + flags)

    def defines(self, family: str) -> dict[str, str]:
        """The #defines a program of `family` reads (cuda/planes.cuh, cuda/route.cu)."""
        reads = READS[family]
        out: dict[str, str] = {}
        if "glu" in reads:
            out["PWCTL_GLU"] = GLUS[self.glu]
            out["PWCTL_EXPERT_BIAS"] = str(int(self.expert_bias))
            if self.glu == "clamped_swiglu":  # (the others' programs name no constants)
                out["SWIGLU_ALPHA"] = f"{self.swiglu_alpha!r}f"
                out["SWIGLU_LIMIT"] = f"{self.swiglu_limit!r}f"
        if "router_bias" in reads:
            out["PWCTL_ROUTER_BIAS"] = str(int(self.router_bias))
        return out

    def for_family(self, family: str) -> Variant:
        """This variant as far as `family` reads it: the default in every field it does not."""
        fields = {f: getattr(self, f) for f in READS[family]}
        if self.glu != "clamped_swiglu":  # the constants only matter to the clamped SwiGLU
            fields.pop("swiglu_alpha", None), fields.pop("swiglu_limit", None)
        return replace(DEFAULT, **fields)


DEFAULT = Variant()
# The variants the models of the recipes ask for (tests/test_nvrtc.py compiles every part of each)
GELU_TANH = Variant(glu="gelu_tanh")  # Gemma-4
GPT_OSS = Variant(glu="clamped_swiglu", expert_bias=True, router_bias=True)
VARIANTS = (DEFAULT, GELU_TANH, GPT_OSS)


def variant_for(
    act: str, expert_bias: bool, router_bias: bool, alpha: float = 1.702, limit: float = 7.0
) -> Variant:
    """The variant of a model's MoE (a recipe's activation name, its biases); ValueError, one
    line, for an activation no kernel computes."""
    if act not in _GLU_OF_ACT:
        raise ValueError(f"activation {act}: the kernels implement {', '.join(_GLU_OF_ACT)}")
    glu = _GLU_OF_ACT[act]
    if glu != "clamped_swiglu":  # the constants are the clamped SwiGLU's alone
        alpha, limit = DEFAULT.swiglu_alpha, DEFAULT.swiglu_limit
    return Variant(glu, expert_bias, router_bias, alpha, limit)


def part_variant(part: int, variant: Variant) -> Variant:
    """The variant part `part` compiles for `variant` (`Variant.for_family` of its family)."""
    return variant.for_family(part_family(part))


def qualified(name: str, variant: Variant) -> str:
    """The launch name of kernel `name` in `variant`'s build: `name` itself where its part
    compiles as the default's (the prep launches always), else 'name@<variant name>'. build and
    launch take either form; a cubin holds the kernel under `name`."""
    v = part_variant(PART_OF[name], variant)
    return name if v == DEFAULT else f"{name}@{v.name}"


def unqualified(launch_name: str) -> tuple[str, Variant]:
    """(kernel name, variant) of a launch name `qualified` made."""
    name, _, tag = launch_name.partition("@")
    return name, _NAMED.get(tag) or _variant_named(tag)


def _variant_named(tag: str) -> Variant:
    """The variant whose `name` is `tag`."""
    items = tag.split("+")
    glu, alpha, limit = DEFAULT.glu, DEFAULT.swiglu_alpha, DEFAULT.swiglu_limit
    if items[0].partition("(")[0] in GLUS:
        glu, _, consts = items.pop(0).partition("(")
        if consts:
            alpha, limit = (float(c) for c in consts.rstrip(")").split(","))
    v = Variant(glu, "expert_bias" in items, "router_bias" in items, alpha, limit)
    _NAMED[tag] = v
    return v


_NAMED: dict[str, Variant] = {"": DEFAULT}
