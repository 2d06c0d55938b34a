"""Expert weights of a pack at per-block widths: the CPU reference execution path.

Widths live in one int array (one entry per block, FP16_WIDTH for the reference weights); the
page table of the runtime issue takes this role on the GPU. Dequantized weights are cached per
(block, width), so switching between a few policies costs one dequantization each.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from pwctl.bitplanes import dequantize
from pwctl.errors import PwctlError
from pwctl.pack import Pack
from pwctl.policy import FP16_WIDTH, Policy

VARIANT_BASE = 100  # width codes of registered variants (baselines), above any real width


class ExpertStore:
    def __init__(self, pack: Pack, device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.pack = pack
        self.device = torch.device(device)
        self.dtype = dtype
        m = pack.manifest
        self.min_bits, self.max_bits = m.min_bits, m.max_bits
        self.widths = np.full(len(pack.blocks), m.max_bits, dtype=np.int64)
        self.act = ACT2FN[m.spec["act"]]
        self._planes: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
        self._reference: dict[str, torch.Tensor] | None = None
        self._cache: dict[tuple[int, int], torch.Tensor] = {}
        self._variants: dict[str, tuple[int, int]] = {}  # name -> (width code, device bytes)

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
        self.widths[:] = max_bits

    def has_variant(self, policy: Policy) -> bool:
        """Whether `policy` names a registered variant (weights outside the pack's planes)."""
        return policy.name in self._variants

    def apply(self, policy: Policy) -> None:
        """Set every block's width for a fixed policy (fp16, uniform:B or a variant)."""
        if policy.name in self._variants:
            self.widths[:] = self._variants[policy.name][0]
        elif policy.name == "fp16":
            self.widths[:] = FP16_WIDTH
        elif policy.name == "uniform":
            if not self.min_bits <= policy.bits <= self.max_bits:
                capped = self.max_bits < self.pack.manifest.max_bits
                raise PwctlError(
                    f"policy {policy}: this pack {'serves' if capped else 'holds'} widths "
                    f"{self.min_bits}..{self.max_bits}{' (--max-bits)' if capped else ''}"
                )
            self.widths[:] = policy.bits
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
        width = int(self.widths[index])
        key = (index, width)
        if key not in self._cache:
            self._cache[key] = self._materialize(index, width).to(self.device, self.dtype)
        return self._cache[key]

    def weight_at(self, index: int, width: int) -> torch.Tensor:
        """Block `index` dequantized at `width`, not cached (profile's sweeps)."""
        return self._materialize(index, width).to(self.device, self.dtype)

    def _materialize(self, index: int, width: int) -> torch.Tensor:
        block = self.pack.blocks[index]
        if width == FP16_WIDTH:
            if self._reference is None:
                self._reference = self.pack.reference()
            return self._reference[block.name]
        if index not in self._planes:
            self._planes[index] = self.pack.load_block(block, self.max_bits)
        planes, tables = self._planes[index]
        table = tables[width].to(self.device)
        return dequantize(planes[:width].to(self.device), table, block.rows_per_table, block.cols)

    def mlp(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate x) * up x) for one expert (shared experts use index num_experts)."""
        idx = self.pack.index
        gate = self.weight(idx[(layer, expert, "gate")])
        up = self.weight(idx[(layer, expert, "up")])
        down = self.weight(idx[(layer, expert, "down")])
        return F.linear(self.act(F.linear(x, gate)) * F.linear(x, up), down)
