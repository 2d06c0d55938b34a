"""The router's choice per token: top-k experts and their weights in the recipe's order (torch).
Every path computes it so or, for CUDA decode, as cuda/route.cu `route_prep` does in one launch
(tested against this)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pwctl.format.recipe import MoESpec


def route(logits: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert weights [T, k] (fp32) and indices [T, k] in the recipe's order."""
    if spec.order == "softmax_topk":
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, index = torch.topk(logits, spec.top_k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=torch.float32)
    return weights * spec.routed_scaling, index
