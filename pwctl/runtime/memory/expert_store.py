"""Expert weights of a pack at per-block widths: the CPU reference execution path.

Widths live in a WidthPlan (one entry per block, FP16_WIDTH for the reference weights; its
`set` is the only writer); the pager's page table holds what the GPU kernels read. Dequantized
weights are cached per (block, width), so switching between a few policies costs one
dequantization each.

Every plane and reference tensor is checked against its CRC before its first use (`Pack.verify`
at start, or the read that loads it). A block with a bad plane serves no wider than the planes
before it (its last good width); a block with no good width for the policy, or whose reference
weights are bad under fp16, raises BlockUnavailable. `faults` lists what failed.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.format.bitplanes import dequantize
from pwctl.format.pack import Fault, Pack
from pwctl.format.recipe import MoESpec
from pwctl.policy import FP16_WIDTH, Kind, Policy
from pwctl.runtime.moe.activation import expert_mlp, glu_of
from pwctl.runtime.widths.width_plan import WidthPlan

VARIANT_BASE = 100  # width codes of registered variants (baselines), above any real width
log = logging.getLogger("pwctl")


class BlockUnavailable(PwctlError):
    """A block failed its checksum and has no good width for what the policy asks of it."""


class ExpertStore:
    def __init__(self, pack: Pack, device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.pack = pack
        self.device = torch.device(device)
        self.dtype = dtype
        m = pack.manifest
        self.min_bits, self.max_bits = m.min_bits, m.max_bits
        self.plan = WidthPlan(len(pack.blocks), m.max_bits)  # the one writer of widths
        self.glu = glu_of(MoESpec(**m.spec))  # (gate x, up x) -> h
        self._planes: dict[int, tuple[torch.Tensor | None, dict[int, torch.Tensor]]] = {}
        self._reference: dict[str, torch.Tensor] | None = None
        self._cache: dict[tuple[int, int], torch.Tensor] = {}
        self._variants: dict[str, tuple[int, int]] = {}  # name -> (width code, device bytes)
        self.faults: list[Fault] = []
        self._good = np.full(len(pack.blocks), m.max_bits, dtype=np.int64)  # widest good width
        self._bad_reference: set[int] = set()

    def add_faults(self, faults: list[Fault]) -> None:
        """Checksum failures (Pack.verify's, or a read's): a bad plane caps its block below
        it; a bad reference tensor makes the block unavailable under fp16. Logged by name."""
        for f in faults:
            index = self.pack.by_name[f.block]
            if f.plane is None:
                self._bad_reference.add(index)
                effect = "its fp16 weights are unavailable"
            else:
                self._good[index] = min(self._good[index], f.plane)
                good = int(self._good[index])
                effect = f"served at {good} bits at most"
                if good < self.min_bits:
                    effect = "no good width left: the block is unavailable"
            log.error("pack fault: %s; %s", f, effect)
        self.faults += faults

    def served_width(self, index: int) -> int:
        """The width block `index` runs at: its planned width, or its last good width below
        that if a plane failed its checksum (BlockUnavailable if there is none)."""
        width = int(self.widths[index])
        if width == FP16_WIDTH:
            if index in self._bad_reference:
                name = self.pack.blocks[index].name
                raise BlockUnavailable(f"{name}: reference weights failed their checksum")
            return width
        if width >= VARIANT_BASE:
            return width
        good = int(self._good[index])
        if good < self.min_bits and width > good:
            name = self.pack.blocks[index].name
            raise BlockUnavailable(f"{name}: plane {good} failed its checksum, no good width")
        return min(width, good)

    @property
    def loaded_blocks(self) -> list[int]:
        """Blocks whose planes have been read into memory, ascending (on one rank's share of a
        pack, its own blocks only: parallel/rank_pack.py)."""
        return sorted(self._planes)

    @property
    def widths(self) -> np.ndarray:
        """Every block's planned width (read-only: `plan.set` changes them)."""
        return self.plan.widths

    def add_variant(self, name: str, weights: dict[int, torch.Tensor], nbytes: int) -> None:
        """Register externally quantized weights of every block (a baseline such as RTN)
        under a policy name of its own, so benches run it through the same engine."""
        code = VARIANT_BASE + len(self._variants)
        self._variants[name] = (code, nbytes)
        for index, w in weights.items():
            self._cache[(index, code)] = w.to(self.device, self.dtype)

    def limit(self, max_bits: int) -> None:
        """Serve no block wider than `max_bits` (a serving-time cap below the pack's parent width:
        narrower blocks decode faster on the GPU). Every block starts at the cap."""
        m = self.pack.manifest
        if not m.min_bits <= max_bits <= m.max_bits:
            raise PwctlError(
                f"--max-bits {max_bits}: this pack holds widths {m.min_bits}..{m.max_bits}"
            )
        self.max_bits = max_bits
        self.plan.set(max_bits)

    def has_variant(self, policy: Policy) -> bool:
        """Whether `policy` names a registered variant (weights outside the pack's planes)."""
        return policy.name in self._variants

    def apply(self, policy: Policy) -> None:
        """Set every block's width for a fixed policy (fp16, uniform:B or a variant)."""
        if policy.name in self._variants:
            self.plan.set(self._variants[policy.name][0])
        elif policy.kind is Kind.FP16:
            self.plan.set(FP16_WIDTH)
        elif policy.kind is Kind.FIXED and policy.bits is not None:
            if not self.min_bits <= policy.bits <= self.max_bits:
                capped = self.max_bits < self.pack.manifest.max_bits
                raise PwctlError(
                    f"policy {policy}: this pack {'serves' if capped else 'holds'} widths "
                    f"{self.min_bits}..{self.max_bits}{' (--max-bits)' if capped else ''}"
                )
            self.plan.set(policy.bits)
        else:
            raise PwctlError(f"policy {policy}: budgeted policies are set by Engine.set_policy")

    def expert_bytes(self) -> int:
        """Device bytes of every expert block at its current width (planes + tables)."""
        for code, nbytes in self._variants.values():
            if self.widths[0] == code:
                return nbytes
        return sum(
            b.fp16_bytes if w == FP16_WIDTH else b.bytes_at(int(w))
            for b, w in zip(self.pack.blocks, self.widths, strict=True)
        )

    def weight(self, index: int) -> torch.Tensor:
        self._load(index, int(self.widths[index]))  # may find a fault: read the width after
        width = self.served_width(index)
        key = (index, width)
        if key not in self._cache:
            self._cache[key] = self._materialize(index, width).to(self.device, self.dtype)
        return self._cache[key]

    def weight_at(self, index: int, width: int) -> torch.Tensor:
        """Block `index` dequantized at `width`, not cached (profile's sweeps)."""
        self._load(index, width)
        if (
            width == FP16_WIDTH
            and index in self._bad_reference
            or (width < FP16_WIDTH and width > self._good[index])
        ):
            raise BlockUnavailable(f"{self.pack.blocks[index].name} at {width} bits: bad checksum")
        return self._materialize(index, width).to(self.device, self.dtype)

    def _load(self, index: int, width: int) -> None:
        """Read (and check) what `width` needs of block `index` once: the reference weights
        of every block, or this block's planes up to the first bad one."""
        if width == FP16_WIDTH and self._reference is None:
            self._reference = self.pack.reference()
            self.add_faults(
                [f for b in self.pack.blocks
                 if (f := self.pack.reference_fault(b, self._reference[b.name])) is not None]
            )  # fmt: skip
        elif width < FP16_WIDTH and index not in self._planes:
            block = self.pack.blocks[index]
            bits = min(self.max_bits, int(self._good[index]))
            planes, tables, fault = self.pack.load_good_planes(block, bits)
            self._planes[index] = (planes, tables)
            if fault is not None:
                self.add_faults([fault])

    def _materialize(self, index: int, width: int) -> torch.Tensor:
        block = self.pack.blocks[index]
        if width == FP16_WIDTH:
            assert self._reference is not None  # loaded by `_load`
            return self._reference[block.name]
        planes, tables = self._planes[index]
        assert planes is not None  # `_load` keeps widths to the good planes
        table = tables[width].to(self.device)
        return dequantize(planes[:width].to(self.device), table, block.rows_per_table, block.cols)

    def mlp(
        self,
        layer: int,
        expert: int,
        x: torch.Tensor,
        bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """down(glu(gate x, up x)) for one expert (shared experts use index num_experts), with
        the expert's (gate, up, down) biases where the recipe has them."""
        idx = self.pack.index
        gate = self.weight(idx[(layer, expert, "gate")])
        up = self.weight(idx[(layer, expert, "up")])
        down = self.weight(idx[(layer, expert, "down")])
        return expert_mlp(x, gate, up, down, self.glu, bias)
