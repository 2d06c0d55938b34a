"""Next tokens from a step's logits: greedy at temperature 0, else temperature + nucleus (top-p)
sampling with each sequence's own generator when it has a seed."""

from __future__ import annotations

import torch

from pwctl.runtime.scheduler import Sequence


def sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    """One token from `logits` [vocab] (fp32) under `seq`'s sampling parameters."""
    p = seq.params
    if p.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p  # keep the smallest set reaching top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=seq.generator))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of `logits` [n, vocab], row i for seqs[i]. Greedy rows take one argmax
    over the batch (one device sync per step, not one per sequence)."""
    greedy = logits.argmax(-1).tolist()
    return [
        g if seq.params.temperature == 0 else sample_one(row, seq)
        for g, row, seq in zip(greedy, logits, seqs, strict=True)
    ]
