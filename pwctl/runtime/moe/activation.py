"""One expert's MLP as every torch path computes it (the store, the fused MoE's torch twin, the
16-bit experts, profile's proxy): down(glu(gate x + b_g, up x + b_u)) + b_d, where `glu` is the
recipe's gated activation and the biases exist only where the recipe says (GPT-OSS).

- "silu" and the other ACT2FN names: act(gate) * up.
- CLAMPED_SWIGLU (GPT-OSS): gate clamped to at most `limit`, up to [-limit, limit], then
  (up + 1) * gate * sigmoid(alpha * gate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from pwctl.format.recipe import CLAMPED_SWIGLU, MoESpec

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float):
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))  # transformers' order: bit-equal


def glu_of(spec: MoESpec) -> Glu:
    """The gated activation of `spec`: (gate, up) -> h."""
    if spec.act == CLAMPED_SWIGLU:
        alpha, limit = spec.swiglu_alpha, spec.swiglu_limit
        return lambda gate, up: clamped_swiglu(gate, up, alpha, limit)
    act = ACT2FN[spec.act]
    return lambda gate, up: act(gate) * up


@dataclass(frozen=True)
class ExpertBias:
    """One layer's routed-expert biases: gate [E, I], up [E, I], down [E, H] (views of the
    MoE block's 16-bit parameters, in the model's dtype)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def of(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate[expert], self.up[expert], self.down[expert]


def expert_mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    glu: Glu,
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One expert on tokens x [T, H]: weights as [out, in] matrices, `bias` (gate, up, down)."""
    bg, bu, bd = (None, None, None) if bias is None else bias
    return F.linear(glu(F.linear(x, gate, bg), F.linear(x, up, bu)), down, bd)
