"""Nested any-precision quantization (APL's scheme, forward-only importance weighting).

Each group of values (one row of a block, or `rows_per_table` rows sharing one table) is sorted
once. A weighted 1-D k-means on the sorted values seeds 2^min_bits clusters; then every cluster
splits in two by the exact weighted 2-means split, level by level, up to max_bits. Lower levels
are never re-optimised, so the top b bits of a label are its b-bit cluster: the first b bit-planes
are a valid b-bit quantization by construction. Each width's table holds the weighted means of
its clusters.

Clusters stay contiguous ranges of the sorted row, so every step works on boundary positions and
prefix sums: k-means is searchsorted + gathers, a split is one vectorised argmax over positions.
The same torch code runs on the CPU and on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}


@dataclass
class NestedQuant:
    labels: torch.Tensor  # uint8 [groups, size]: max_bits-bit cluster id of every value
    tables: dict[int, torch.Tensor]  # width -> float32 [groups, 2^width] cluster means


def quantize_nested(
    values: torch.Tensor,
    importance: torch.Tensor | None,
    min_bits: int,
    max_bits: int,
    seed_iters: int = 40,
) -> NestedQuant:
    """Quantize each row of `values` [groups, size]; `importance` broadcasts to the same shape."""
    if not 1 <= min_bits <= max_bits <= 8:
        raise ValueError(f"need 1 <= min_bits <= max_bits <= 8, got {min_bits}, {max_bits}")
    groups, size = values.shape
    step = max(1, CHUNK_ELEMENTS.get(values.device.type, 1 << 22) // size)
    parts = []
    for g in range(0, groups, step):
        imp = None if importance is None else importance[g : g + step]
        parts.append(_quantize_rows(values[g : g + step], imp, min_bits, max_bits, seed_iters))
    labels = torch.cat([p.labels for p in parts])
    tables = {b: torch.cat([p.tables[b] for p in parts]) for b in parts[0].tables}
    return NestedQuant(labels, tables)


def _quantize_rows(
    w: torch.Tensor, imp: torch.Tensor | None, min_bits: int, max_bits: int, iters: int
) -> NestedQuant:
    g, m = w.shape
    sw, order = torch.sort(w.float(), dim=1)
    if imp is None:
        si = torch.ones_like(sw, dtype=torch.float64)
    else:
        si = imp.expand(g, m).gather(1, order).double()
        scale = si.mean(dim=1, keepdim=True)
        # zero weight would make a cluster mean 0/0; an all-zero row falls back to unweighted
        si = torch.where(scale > 0, torch.maximum(si, 1e-6 * scale), torch.ones_like(si))
    zero = torch.zeros(g, 1, dtype=torch.float64, device=w.device)
    cw = torch.cat([zero, si.cumsum(1)], 1)
    cs = torch.cat([zero, (si * sw.double()).cumsum(1)], 1)

    bnd = _kmeans_seed(sw, cw, cs, 1 << min_bits, iters)
    tables = {min_bits: _means(bnd, cw, cs, _value_at(sw, bnd))}
    for b in range(min_bits + 1, max_bits + 1):
        bnd = _split_all(bnd, cw, cs, m)
        tables[b] = _means(bnd, cw, cs, tables[b - 1].repeat_interleave(2, dim=1))

    pos = torch.arange(m, device=w.device).expand(g, m).contiguous()
    sorted_labels = torch.searchsorted(bnd, pos, right=True) - 1
    labels = torch.empty_like(sorted_labels).scatter_(1, order, sorted_labels)
    return NestedQuant(labels.to(torch.uint8), tables)


def _value_at(sw: torch.Tensor, bnd: torch.Tensor) -> torch.Tensor:
    """A stand-in mean for empty clusters: the sorted value at the cluster's start."""
    return sw.gather(1, bnd[:, :-1].clamp(max=sw.shape[1] - 1)).double()


def _means(bnd: torch.Tensor, cw: torch.Tensor, cs: torch.Tensor, fallback: torch.Tensor):
    wsum = cw.gather(1, bnd[:, 1:]) - cw.gather(1, bnd[:, :-1])
    ssum = cs.gather(1, bnd[:, 1:]) - cs.gather(1, bnd[:, :-1])
    empty = bnd[:, 1:] == bnd[:, :-1]
    return torch.where(empty, fallback, ssum / wsum.clamp_min(1e-300)).float()


def _kmeans_seed(sw, cw, cs, k: int, iters: int) -> torch.Tensor:
    """Weighted Lloyd on sorted values from weighted-quantile boundaries; returns [g, k+1]."""
    g, m = sw.shape
    total = cw[:, -1:]
    targets = total * torch.arange(1, k, device=sw.device, dtype=torch.float64) / k
    inner = torch.searchsorted(cw.contiguous(), targets.contiguous()).clamp(0, m)
    first = torch.zeros(g, 1, dtype=torch.long, device=sw.device)
    last = torch.full((g, 1), m, dtype=torch.long, device=sw.device)
    bnd = torch.cat([first, inner, last], 1)
    for _ in range(iters):
        c = _means(bnd, cw, cs, _value_at(sw, bnd))
        mids = ((c[:, :-1] + c[:, 1:]) / 2).contiguous()
        inner = torch.searchsorted(sw.contiguous(), mids).cummax(dim=1).values
        new = torch.cat([first, inner, last], 1)
        if torch.equal(new, bnd):
            break
        bnd = new
    return bnd


def _split_all(bnd: torch.Tensor, cw: torch.Tensor, cs: torch.Tensor, m: int) -> torch.Tensor:
    """Split every cluster [a, e) at the p maximising Sl^2/Wl + Sr^2/Wr (exact 2-means)."""
    g, k = bnd.shape[0], bnd.shape[1] - 1
    dev = bnd.device
    # cluster of each candidate split position p = 1..m-1: inner boundaries at or before p
    marks = torch.zeros(g, m + 1, dtype=torch.int32, device=dev)
    marks.scatter_add_(1, bnd[:, 1:-1], torch.ones_like(bnd[:, 1:-1], dtype=torch.int32))
    cid = marks.cumsum(1, dtype=torch.int32)[:, 1:m].long()
    cw_b, cs_b = cw.gather(1, bnd), cs.gather(1, bnd)  # prefix sums at boundaries [g, k+1]
    cwp, csp = cw[:, 1:m], cs[:, 1:m]
    wl, sl = cwp - cw_b.gather(1, cid), csp - cs_b.gather(1, cid)
    wr, sr = cw_b.gather(1, cid + 1) - cwp, cs_b.gather(1, cid + 1) - csp
    valid = (wl > 0) & (wr > 0)  # weights are positive, so this is a < p < e
    obj = torch.where(valid, sl * sl / wl + sr * sr / wr, -1.0)

    flat = (cid + torch.arange(g, device=dev).unsqueeze(1) * k).reshape(-1)
    obj = obj.reshape(-1)
    best = torch.full((g * k,), -1.0, dtype=obj.dtype, device=dev)
    best.scatter_reduce_(0, flat, obj, "amax")
    p = torch.arange(1, m, device=dev).expand(g, m - 1).reshape(-1)
    cand = torch.where(valid.reshape(-1) & (obj == best[flat]), p, m + 1)
    pos = torch.full((g * k,), m + 1, dtype=torch.long, device=dev)
    pos.scatter_reduce_(0, flat, cand, "amin")
    ends = bnd[:, 1:].reshape(-1)
    split = torch.where(pos > m, ends, pos).view(g, k)  # unsplittable: right child empty
    out = torch.stack([bnd[:, :-1], split], dim=2).reshape(g, 2 * k)
    return torch.cat([out, bnd[:, -1:]], 1)
