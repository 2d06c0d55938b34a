"""The router's choice per token: top-k experts and their weights in the recipe's order (torch).
Every path computes it so or, for CUDA decode, as cuda/route.cu `route_prep` does in one launch
(tested against this)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pwctl.format.recipe import MoESpec


def route(
    logits: torch.Tensor, spec: MoESpec, expert_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert weights [T, k] (fp32) and indices [T, k] in the recipe's order;
    `expert_scale` [E] (spec.expert_scale): each weight times its expert's learned scale."""
    if spec.order == "softmax_topk":
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, index = torch.topk(logits, spec.top_k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=torch.float32)
    if expert_scale is not None:
        weights = weights * expert_scale[index]
    return weights * spec.routed_scaling, index


class ResidualRouter(nn.Module):
    """A router module of its own (spec.own_router: Gemma-4's), reading the residual stream.
    Parameter names are transformers' (`proj`, `scale`, `per_expert_scale`), so its weights load
    as they are. Called as transformers' router is: (logits, top-k weights, top-k indices)."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.proj = nn.Linear(spec.hidden, spec.num_experts, bias=False)
        norm, E = spec.router_norm != "none", spec.num_experts
        self.scale = nn.Parameter(torch.ones(spec.hidden)) if norm else None
        self.per_expert_scale = nn.Parameter(torch.ones(E)) if spec.expert_scale else None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] of residual rows x [T, H]."""
        if self.scale is not None:  # "rms_scaled": RMSNorm without a weight, in fp32, as Gemma's
            xf = x.float()
            xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.spec.norm_eps, -0.5)
            x = xf.type_as(x) * self.scale * self.spec.hidden**-0.5
        return self.proj(x)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.project(x)
        weights, index = route(logits, self.spec, self.per_expert_scale)
        return logits, weights, index
