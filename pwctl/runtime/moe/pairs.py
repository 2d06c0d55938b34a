"""(token, expert) pairs of a routing result, grouped by expert: what both the kernels and the
torch path iterate over. Grouping never syncs the host (CUDA graphs)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from pwctl.kernels import launch


@dataclass
class Pairs:
    """(token, expert) pairs sorted by expert, and the slots (one per active expert) over them."""

    token: torch.Tensor  # int32 [pairs]
    weight: torch.Tensor  # float32 [pairs]
    expert: torch.Tensor  # int32 [slots]: expert of each slot (block_ids row)
    lo: torch.Tensor  # int32 [slots]
    hi: torch.Tensor  # int32 [slots]; hi == lo: empty slot

    def slot_args(self) -> tuple:
        p = launch.ptr
        return (p(self.expert), p(self.lo), p(self.hi), p(self.token), p(self.weight))

    def kernel_args(self, block_ids: torch.Tensor) -> tuple:
        return self.slot_args() + (launch.ptr(block_ids), np.int32(block_ids.shape[0]))


def sort_by_expert(
    index: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A routing result's (token, slot) pairs in expert order, without a host sync: the order
    into the flattened pairs, each expert's pair count and the running ends of those counts."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=index.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync (graph capture)
    return order, counts, counts.cumsum(0)


def group(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Pairs:
    """Pairs of a routing result, sorted by expert, without a host sync: the slot count is the
    bound min(E, T*k); slots past the number of active experts are empty."""
    T, k = index.shape
    order, counts, ends = sort_by_expert(index, num_experts)
    active = torch.argsort((counts == 0).to(torch.int8), stable=True)[: min(num_experts, T * k)]
    n_active = (counts > 0).sum()
    live = torch.arange(active.numel(), device=index.device) < n_active
    lo = torch.where(live, ends[active] - counts[active], 0)
    hi = torch.where(live, ends[active], 0)
    i32 = torch.int32
    return Pairs(
        token=(order // k).to(i32),
        weight=weights.reshape(-1)[order].float(),
        expert=active.to(i32),
        lo=lo.to(i32),
        hi=hi.to(i32),
    )


def pair_buffers(n: int, slots: int, device: torch.device) -> Pairs:
    """Uninitialized pairs and slots, for a prep launch to fill."""
    i32 = torch.int32
    return Pairs(
        token=torch.empty(n, dtype=i32, device=device),
        weight=torch.empty(n, dtype=torch.float32, device=device),
        expert=torch.empty(slots, dtype=i32, device=device),
        lo=torch.empty(slots, dtype=i32, device=device),
        hi=torch.empty(slots, dtype=i32, device=device),
    )


def decode_buffers(
    T: int, k: int, num_experts: int, wpad: int, device: torch.device
) -> tuple[Pairs, torch.Tensor]:
    """What `prepare_decode` fills for T tokens of top-k routing: pairs, slots, x in fragment
    order (uninitialized)."""
    pairs = pair_buffers(T * k, min(num_experts, T * k), device)
    return pairs, torch.empty(T, wpad, 32, dtype=torch.float16, device=device)


@functools.lru_cache(maxsize=256)  # bounded: prefill meets every prompt length
def _all_tokens(T: int, expert: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    i32 = torch.int32
    return (
        torch.arange(T, dtype=i32, device=device),
        torch.ones(T, device=device),
        torch.full((1,), expert, dtype=i32, device=device),
        torch.zeros(1, dtype=i32, device=device),
        torch.full((1,), T, dtype=i32, device=device),
    )


def all_tokens(T: int, scale: torch.Tensor | None, expert: int, device: torch.device) -> Pairs:
    """One slot holding every token (the shared expert), weighted by its gate. Its constant
    tensors are made once per (T, expert, device): no launch and no host copy per call (graphs)."""
    # under stream capture the fills are only recorded, not run: nothing to cache then
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    make = _all_tokens.__wrapped__ if capturing else _all_tokens
    token, ones, experts, lo, hi = make(T, expert, device)
    weight = ones if scale is None else scale.reshape(-1).float()
    return Pairs(token=token, weight=weight, expert=experts, lo=lo, hi=hi)
