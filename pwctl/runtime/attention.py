"""Paged attention behind transformers' AttentionInterface.

The engine runs the model on one packed row of every scheduled token (per-token positions, no
padding, no transformers cache). transformers computes q, k, v (projections, q/k norms, RoPE)
and hands them to `paged_attention`, which writes this step's k, v into the paged KV cache at
their slots and attends each sequence's queries over its cached keys, read through its block
table (`KVCache.write` / `read`: the cache's own tensors on the store backend, slabs of the
paged backend's arena otherwise). An attention name transformers has no mask function for
makes it skip mask creation, so masking (causal, sliding window, sequence boundaries) happens
here. CPU path: one SDPA call per sequence; the GPU path replaces this function with a paged
kernel reading the same tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pwctl.runtime.kv_cache import KVCache

ATTN_NAME = "pwctl_paged"


@dataclass
class SeqSpan:
    """One sequence of the packed batch: its queries q_start..q_stop-1 (packed rows), at
    positions past..past+n-1, attend to cache rows `kv_slots` (positions 0..past+n-1)."""

    q_start: int
    q_stop: int
    past: int
    kv_slots: torch.Tensor


@dataclass
class PagedBatch:
    """What every attention layer of one step needs (built once per step)."""

    kv: KVCache
    slots: torch.Tensor  # [T] cache row of each packed token
    spans: list[SeqSpan]


def _mask(span: SeqSpan, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [n, L] mask (True: attend); None when plain causal from 0 or a lone query."""
    n, total = span.q_stop - span.q_start, span.past + span.q_stop - span.q_start
    if (window is None or total <= window) and (n == 1 or span.past == 0):
        return None
    q_pos = torch.arange(span.past, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, q_heads, T, D]
    key: torch.Tensor,  # [1, kv_heads, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    pwctl_batch: PagedBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    if pwctl_batch is None:
        raise RuntimeError(f"{ATTN_NAME} attention runs only inside Engine.step")
    batch, layer = pwctl_batch, module.layer_idx
    kv = batch.kv
    kv.write(layer, batch.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    window = sliding_window if isinstance(sliding_window, int) and sliding_window > 0 else None
    groups = query.shape[1] // key.shape[1]
    out = torch.empty_like(query[0].transpose(0, 1))  # [T, q_heads, D]
    for span in batch.spans:
        q = query[0, :, span.q_start : span.q_stop]
        k, v = kv.read(layer, span.kv_slots)
        k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
        if groups > 1:
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        mask = _mask(span, window, q.device)
        causal = mask is None and q.shape[1] > 1
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scaling)
        out[span.q_start : span.q_stop] = o.transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, paged_attention)
