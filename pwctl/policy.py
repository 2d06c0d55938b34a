"""Policy and BUDGET strings (MISSION.md conventions), parsed once for every command."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from pwctl.errors import PwctlError

BUDGETED = (
    "static",
    "dynamic-layer",
    "pagedweight",
    "pagedweight-router",
    "pagedweight-residual",
    "pagedweight-paging",
    "pagedweight-sensitivity",
)
UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
FP16_WIDTH = 16  # the width code of the unquantized reference weights
AUTO = "auto"  # --policy auto: the engine chooses (Engine.auto_policy)
AUTO_MAX_BITS = 4  # ... and serves no block wider unless --max-bits says so (decode speed)


def auto_max_bits(max_bits: int | None, pack_min: int, pack_max: int) -> int | None:
    """The widest width `--policy auto` serves: --max-bits if given, else AUTO_MAX_BITS within
    the pack's widths (None: the pack's own widest)."""
    if max_bits is not None:
        return max_bits
    return min(AUTO_MAX_BITS, pack_max) if pack_min <= AUTO_MAX_BITS else None


@dataclass(frozen=True)
class Budget:
    """A fraction of the fp16 expert bytes, or an absolute size in bytes."""

    fraction: float | None = None
    nbytes: int | None = None

    def resolve(self, fp16_bytes: int) -> int:
        if self.fraction is not None:
            return int(self.fraction * fp16_bytes)
        assert self.nbytes is not None  # one of the two is set
        return self.nbytes

    def __str__(self) -> str:
        return f"{self.fraction:g}" if self.fraction is not None else f"{self.nbytes}B"


class Kind(Enum):
    """What a policy is, parsed once: the runtime switches on this, never on names."""

    FP16 = "fp16"  # the unquantized reference weights
    FIXED = "fixed"  # uniform:B (or a registered variant): one width for every block
    STATIC = "static"  # static:BUDGET: planned once from the offline sensitivity
    PER_LAYER = "per-layer"  # dynamic-layer:BUDGET: one width a layer, re-chosen each step
    DYNAMIC = "dynamic"  # pagedweight:BUDGET and its ablations: the PagedWeight planner


KINDS = {"fp16": Kind.FP16, "uniform": Kind.FIXED, "static": Kind.STATIC,
         "dynamic-layer": Kind.PER_LAYER}  # fmt: skip
ABLATIONS = {  # pagedweight ablation -> the planner signal it switches off (PlannerConfig field)
    "pagedweight-router": "use_router_stats",
    "pagedweight-residual": "use_residual",
    "pagedweight-paging": "dynamic_paging",
    "pagedweight-sensitivity": "global_sensitivity",
}


@dataclass(frozen=True)
class Policy:
    name: str
    bits: int | None = None
    budget: Budget | None = None

    @property
    def kind(self) -> Kind:
        """Any other name (pagedweight, its ablations) runs the PagedWeight planner; a
        registered variant (a baseline such as rtn-g128:3) counts as fixed."""
        if self.name in KINDS:
            return KINDS[self.name]
        return Kind.DYNAMIC if self.budget is not None else Kind.FIXED

    @property
    def switched_off(self) -> str | None:
        """The planner signal an ablation switches off (None: pagedweight itself, or not one)."""
        return ABLATIONS.get(self.name)

    def __str__(self) -> str:
        if self.bits is not None:
            return f"{self.name}:{self.bits}"
        return self.name if self.budget is None else f"{self.name}:{self.budget}"


def fraction_or_size(text: str, what: str) -> tuple[float | None, int | None]:
    """(fraction in (0, 1], None) or (None, bytes) of a BUDGET or --memory-budget text; `what`
    names it in the one-line error."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text.strip().lower())
    if not m:
        raise PwctlError(f"{what} {text!r}: use a fraction in (0, 1] or a size such as 800MB")
    value, unit = float(m.group(1)), m.group(2)
    if not unit:
        if not 0 < value <= 1:
            raise PwctlError(f"{what} {text!r}: a fraction must be in (0, 1]")
        return value, None
    if unit not in UNITS:
        raise PwctlError(f"{what} {text!r}: unknown unit {unit!r} (use {', '.join(UNITS)})")
    if value * UNITS[unit] < 1:
        raise PwctlError(f"{what} {text!r}: must be at least one byte")
    return None, int(value * UNITS[unit])


def parse_budget(text: str) -> Budget:
    fraction, nbytes = fraction_or_size(text, "bad BUDGET")
    return Budget(fraction=fraction, nbytes=nbytes)


def parse_policy(text: str) -> Policy:
    name, _, arg = text.strip().partition(":")
    if name == "fp16" and not arg:
        return Policy("fp16")
    if name == "uniform":
        if not arg.isdigit() or not 1 <= int(arg) <= 8:
            raise PwctlError(f"bad policy '{text}': uniform:B needs B in 1..8")
        return Policy("uniform", bits=int(arg))
    if name in BUDGETED:
        if not arg:
            raise PwctlError(f"bad policy '{text}': {name} needs a BUDGET, e.g. {name}:0.35")
        return Policy(name, budget=parse_budget(arg))
    raise PwctlError(
        f"unknown policy '{text}'; policies: fp16, uniform:B, "
        + ", ".join(f"{n}:BUDGET" for n in BUDGETED)
    )


@dataclass(frozen=True)
class BudgetArg:
    """A parsed `--memory-budget`: a size in bytes, or a fraction (of free GPU memory on CUDA;
    on the CPU of what the engine would need for every sequence at full length)."""

    nbytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str | int | None) -> BudgetArg | None:
        if text is None:
            return None
        if isinstance(text, int):
            return cls(nbytes=text)
        fraction, nbytes = fraction_or_size(str(text), "--memory-budget")
        return cls(nbytes=nbytes, fraction=fraction)

    def resolve(self, device: str, full_need: int) -> int:
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None  # one of the two is set
        if device.startswith("cuda"):
            import torch

            return int(self.fraction * torch.cuda.mem_get_info(torch.device(device))[0])
        return int(self.fraction * full_need)

    def __str__(self) -> str:
        return f"{self.nbytes}b" if self.nbytes is not None else f"{self.fraction:g}"
