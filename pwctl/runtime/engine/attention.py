"""Paged attention behind transformers' AttentionInterface.

The engine runs the model on one packed row of every scheduled token (per-token positions, no
padding, no transformers cache). transformers computes q, k, v (projections, q/k norms, RoPE)
and hands them to `paged_attention`, which writes this step's k, v into the paged KV cache at
their slots and attends each sequence's queries over its cached keys, read through its block
table (`KVCache.write` / `read`: the cache's own tensors on the store backend, slabs of the
paged backend's arena otherwise). An attention name transformers has no mask function for
makes it skip mask creation, so masking (causal, sliding window, sequence boundaries) happens
here. Decoding sequences (one query each) are attended together: one gather of their keys and
values padded to the longest, one masked SDPA; sequences with several queries (prefill chunks)
get one SDPA each. A paged attention kernel reading the same tables is the GPU step after this.

Two forms of a step's metadata: `PagedBatch` (any step, built on the host from its spans) and
`DecodeBatch` (a step whose every sequence decodes one token, in fixed-shape tensors computed
on the device: what a CUDA graph of the step reads, runtime/engine/decode_graphs.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from transformers import AttentionInterface

from pwctl.runtime.memory.kv_cache import KVCache, KVRows

ATTN_NAME = "pwctl_paged"


# SDPA backends for steps whose shapes vary (packed rows: cache lengths grow every step, prompts
# differ). torch picks cuDNN's attention on the H200, which builds a plan for every new shape:
# 70-100 ms a call the first time, 0.07-0.1 ms after (docs/decisions/037-sdpa-varying-shapes.md),
# and eager decode meets a new cache length every step. Fixed-shape decode graphs keep the default.
VARYING_SHAPE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def attention_implementation(model: nn.Module, name: str):
    """Switch the model's attention function for the duration (the reference path keeps sdpa)."""
    config: Any = model.config  # a transformers config
    old = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old


@dataclass
class SeqSpan:
    """One sequence of the packed batch: its queries q_start..q_stop-1 (packed rows), at
    positions past..past+n-1, attend to cache rows `kv_slots` (positions 0..past+n-1; a host
    tensor: located on the device once a step, with the rest of the step's)."""

    q_start: int
    q_stop: int
    past: int
    kv_slots: torch.Tensor


@dataclass
class DecodeGroup:
    """The one-query spans of a step, padded together: query rows [S], their cache rows located
    (`KVCache.locate` of [S, L] rows, flat; padding repeats the row's first and is masked out)
    and the mask [S, 1, 1, L] (True: attend)."""

    rows: torch.Tensor
    cached: KVRows
    mask: torch.Tensor


@dataclass
class PagedBatch:
    """What every attention layer of one step needs (built once per step): the cache rows of
    the step's tokens located for every layer at once, and those the spans attend to located on
    the first layer that reads them, reused by the rest."""

    kv: KVCache
    slots: torch.Tensor  # [T] cache row of each packed token
    spans: list[SeqSpan]
    new: KVRows = field(init=False)  # where every layer writes this step's keys and values
    _decode: dict[int | None, DecodeGroup | None] = field(default_factory=dict)
    _span_rows: dict[int, KVRows] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.new = self.kv.locate(self.slots)

    def decode_group(self, window: int | None) -> DecodeGroup | None:
        """The step's decode spans batched; None when fewer than two spans decode."""
        if window not in self._decode:
            self._decode[window] = _decode_group(self.kv, self.spans, window, self.slots.device)
        return self._decode[window]

    def span_rows(self, i: int) -> KVRows:
        """The cache rows span `i` attends to."""
        if i not in self._span_rows:
            self._span_rows[i] = self.kv.locate(self.spans[i].kv_slots)
        return self._span_rows[i]


def _decode_group(
    kv: KVCache, spans: list[SeqSpan], window: int | None, device
) -> DecodeGroup | None:
    ones = [s for s in spans if s.q_stop - s.q_start == 1]
    if len(ones) < 2:
        return None
    lengths = torch.tensor([s.kv_slots.numel() for s in ones])
    # padding repeats each row's first cache row: written, so finite (a free block's slab may
    # hold plane bytes, and a NaN key or value there would leak through the mask into the sum)
    slots = torch.stack([s.kv_slots[:1] for s in ones]).repeat(1, int(lengths.max()))
    for i, s in enumerate(ones):
        slots[i, : s.kv_slots.numel()] = s.kv_slots
    rows = torch.tensor([s.q_start for s in ones]).to(device)
    cached = kv.locate(slots.to(device).reshape(-1))
    return DecodeGroup(rows, cached, length_mask(lengths.to(device), slots.shape[1], window))


def length_mask(lengths: torch.Tensor, L: int, window: int | None) -> torch.Tensor:
    """[S, 1, 1, L] mask (True: attend) of S one-query rows over L cache rows, row i's query at
    position lengths[i] - 1 (its cache rows 0..lengths[i]-1, the last `window` of them)."""
    pos = torch.arange(L, device=lengths.device)[None, :]
    mask = pos < lengths[:, None]
    if window is not None:
        mask &= pos > lengths[:, None] - 1 - window
    return mask[:, None, None, :]


@dataclass
class DecodeBatch:
    """A step whose every sequence decodes one token, in fixed-shape device tensors (a CUDA
    graph's inputs: runtime/engine/decode_graphs.py): row i writes its token's keys and values at
    cache row `slots[i]` and attends to rows `table[i, :lengths[i]]` (past that, `table[i]`
    repeats a row of its own, masked out). Every row is in one decode group, even a lone one."""

    kv: KVCache
    slots: torch.Tensor  # [S]
    table: torch.Tensor  # [S, L]
    lengths: torch.Tensor  # [S]
    spans: list[SeqSpan] = field(default_factory=list)  # none: no row attends on its own
    new: KVRows = field(init=False)
    _decode: dict[int | None, DecodeGroup] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.new = self.kv.locate(self.slots)

    def decode_group(self, window: int | None) -> DecodeGroup:
        if window not in self._decode:
            S, L = self.table.shape
            rows = torch.arange(S, device=self.slots.device)
            cached = self.kv.locate(self.table.reshape(-1))
            self._decode[window] = DecodeGroup(rows, cached, length_mask(self.lengths, L, window))
        return self._decode[window]


def _mask(span: SeqSpan, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [n, L] mask (True: attend); None when plain causal from 0 or a lone query."""
    n, total = span.q_stop - span.q_start, span.past + span.q_stop - span.q_start
    if (window is None or total <= window) and (n == 1 or span.past == 0):
        return None
    return _allowed(span, window, device)


def _allowed(span: SeqSpan, window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [n, L] mask (True: attend) of a span's queries over its cache rows."""
    total = span.past + span.q_stop - span.q_start
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
    pwctl_batch: PagedBatch | DecodeBatch | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """`s_aux`: GPT-OSS's attention sinks, a logit a query head [q_heads] that joins the
    softmax with no value (`_with_sinks`)."""
    if pwctl_batch is None:
        raise RuntimeError(f"{ATTN_NAME} attention runs only inside Engine.step")
    batch, kv = pwctl_batch, pwctl_batch.kv
    attn_layer = cast(int, module.layer_idx)  # transformers' attention modules
    layer = kv.layout.source(attn_layer)  # its cache layer (shared-KV layers: an earlier one's)
    if kv.layout.owns(attn_layer):  # a shared-KV layer's keys and values are already there
        kv.write(layer, batch.new, key[0].transpose(0, 1), value[0].transpose(0, 1))
    window = sliding_window if isinstance(sliding_window, int) and sliding_window > 0 else None
    groups = query.shape[1] // key.shape[1]
    out = torch.empty_like(query[0].transpose(0, 1))  # [T, q_heads, D]
    group = batch.decode_group(window)
    if group is not None:
        out[group.rows] = _attend_decode(query, kv, layer, group, groups, scaling, s_aux)
    for i, span in enumerate(batch.spans):
        if group is not None and span.q_stop - span.q_start == 1:
            continue
        q = query[0, :, span.q_start : span.q_stop]
        assert isinstance(batch, PagedBatch)  # a DecodeBatch has no spans
        k, v = kv.read(layer, batch.span_rows(i))
        k, v = k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
        mask = _mask(span, window, q.device)
        if s_aux is not None:  # [q_heads, n, L + 1] float: the sink's logit in the last column
            sinks = s_aux.to(q.dtype).view(-1, 1, 1)
            k, v, mask = _with_sinks(k, v, _allowed(span, window, q.device)[None], sinks)
        causal = mask is None and q.shape[1] > 1
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=groups > 1
        )
        out[span.q_start : span.q_stop] = o.transpose(0, 1)
    return out.unsqueeze(0), None


def _with_sinks(
    k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key: keys and values [..., L, D] get a row of zeros, whose
    score q.0 * scale is exactly the float mask's value there, the head's sink logit; the mask
    [..., Lq, L + 1] is 0 / -inf from `allowed` [..., Lq, L] before it. The softmax then runs
    over the real keys and the sink, which adds nothing to the sum (transformers' eager
    attention of GPT-OSS), and SDPA keeps its kernels. `sinks` broadcasts against `allowed`'s
    leading dims with a trailing [1, 1]. Fixed shapes in, fixed shapes out (CUDA graphs)."""
    zeros = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    k, v = torch.cat([k, zeros], dim=-2), torch.cat([v, zeros.to(v.dtype)], dim=-2)
    lead = torch.broadcast_shapes(allowed.shape[:-1], sinks.shape[:-1])
    never = torch.full((), float("-inf"), dtype=sinks.dtype, device=k.device)
    bias = torch.where(allowed, torch.zeros_like(never), never)
    mask = torch.cat([bias.expand(*lead, allowed.shape[-1]), sinks.expand(*lead, 1)], dim=-1)
    return k, v, mask


def _attend_decode(
    query: torch.Tensor,
    kv: KVCache,
    layer: int,
    group: DecodeGroup,
    groups: int,
    scaling,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """[S, q_heads, D] outputs of the decode spans: one gather, one masked SDPA. Grouped
    query heads attend as `groups` queries of their key/value head ([S, kv_heads, groups, D]:
    query head h reads key/value head h // groups, as enable_gqa's repeat does), so SDPA never
    expands keys and values to every query head: with a mask and enable_gqa torch falls back to
    its math kernel, which did (in float32), and an eager step beside a prefill chunk held
    ~2 GB more than the workspace counts (Qwen1.5-MoE shape, 30 sequences: decision 041)."""
    S, L = group.mask.shape[0], group.mask.shape[-1]
    k, v = kv.read(layer, group.cached)
    q = query[0][:, group.rows].transpose(0, 1)  # [S, q_heads, D]
    kv_heads, D = k.shape[1], q.shape[-1]
    q = q.reshape(S, kv_heads, groups, D)
    k = k.view(S, L, kv_heads, D).transpose(1, 2).to(q.dtype)  # [S, kv_heads, L, D]
    v = v.view(S, L, kv_heads, D).transpose(1, 2).to(q.dtype)
    mask = group.mask
    if s_aux is not None:  # [S, kv_heads, groups, L + 1]: the sinks in the last column
        sinks = s_aux.to(q.dtype).view(1, kv_heads, groups, 1)
        k, v, mask = _with_sinks(k, v, mask, sinks)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return o.reshape(S, kv_heads * groups, D)


AttentionInterface.register(ATTN_NAME, paged_attention)
