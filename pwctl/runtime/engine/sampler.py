"""Next tokens from a step's logits: greedy at temperature 0, else temperature + nucleus (top-p)
sampling, every row of the step at once on the logits' device and one host sync for all of them
(a row at a time, on the host, took 0.7-15 ms a row on the dev VM at vocabularies of 32k-152k:
docs/decisions/040-sampler-rows-at-once.md).

A sampled row draws by an exponential race: with E_j ~ Exp(1) independent, argmax_j p_j / E_j is
token j with probability p_j / sum(p), so one argmax replaces a multinomial. The noise is indexed
by token id and a row with a seed draws its own from its sequence's generator, so a seeded row's
tokens do not depend on the other rows of its step.

Nothing here waits for the GPU: the tokens stay on the device (an overlapped next step reads
them there) and `SampledTokens` queues their copy to the host (batcher.py reads it a step
later)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pwctl.runtime.engine.scheduler import Sequence
from pwctl.runtime.transfer import HostCopies, to_device

NUCLEUS_K = 1024  # top-p ranks this many tokens first; all of them if the nucleus is wider
BISECTION_STEPS = 30  # a nucleus wider than NUCLEUS_K on the device: its threshold to 2**-30


@dataclass(frozen=True)
class SampledTokens:
    """One step's tokens: `device` [n] where the next step's inputs can read them, and their
    copy on its way to the host (`host` waits for it alone, not for later steps)."""

    device: torch.Tensor
    copies: HostCopies

    @classmethod
    def queue(cls, tokens: torch.Tensor) -> SampledTokens:
        return cls(tokens, HostCopies.queue(tokens))

    def host(self) -> list[int]:
        (tokens,) = self.copies.wait()
        assert tokens is not None  # queued from a tensor
        return tokens.tolist()


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of `logits` [n, vocab] (fp32), row i under seqs[i]'s parameters."""
    return sample_tokens(logits, seqs).tolist()


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`sample`'s tokens [n] (int64) on the logits' device, queued (nothing waits for them)."""
    tokens = logits.argmax(-1)
    drawn = [i for i, seq in enumerate(seqs) if seq.params.temperature > 0]
    if drawn:
        rows = to_device(drawn, torch.long, logits.device)
        tokens[rows] = draw(logits[rows], [seqs[i] for i in drawn])
    return tokens


def draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Tokens [n] drawn from rows of `logits` [n, vocab] at each sequence's temperature (> 0)
    and top-p."""
    device = logits.device
    temperature = to_device([s.params.temperature for s in seqs], logits.dtype, device)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    if any(s.params.top_p < 1 for s in seqs):
        top_p = to_device([s.params.top_p for s in seqs], probs.dtype, device)
        probs = probs * nucleus(probs, top_p)
    # a floor under the noise: a 0 (U = 1, which torch.rand should never give) would make
    # 0 / 0 of a masked token, a NaN that argmax takes
    noise = exponential(probs, seqs).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / noise).argmax(-1)


def nucleus(
    probs: torch.Tensor, top_p: torch.Tensor, sync_free: bool | None = None
) -> torch.Tensor:
    """Mask [n, vocab] of each row's nucleus: its most likely tokens, fewest first, until they
    reach top_p (all tokens where top_p is 1). A row whose top NUCLEUS_K tokens fall short of
    its top_p needs the tokens past them: a full sort, which the host must ask the device for
    (it waits for every step queued), or, `sync_free` (the default on CUDA), a threshold found
    by bisection on the device for every row at once (ties at it all kept)."""
    k = min(probs.shape[-1], NUCLEUS_K)
    top, order = probs.topk(k, dim=-1)
    mask = _smallest_reaching(probs, top, order, top_p)
    short = (top.sum(-1) < top_p) & (top_p < 1)  # rows whose nucleus goes past the k-th token
    if k < probs.shape[-1]:
        if probs.is_cuda if sync_free is None else sync_free:
            mask = torch.where(short[:, None], probs >= threshold(probs, top_p, top[:, -1]), mask)
        elif bool(short.any()):
            mask = _smallest_reaching(probs, *probs.sort(dim=-1, descending=True), top_p)
    return mask | (top_p[:, None] >= 1)


def _smallest_reaching(
    probs: torch.Tensor, top: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask [n, vocab] of the smallest set of each row's `top` probabilities (at `order`, most
    likely first) that reaches its top_p."""
    keep = top.cumsum(-1) - top < top_p[:, None]
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, keep)


def threshold(probs: torch.Tensor, top_p: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Per row [n, 1], the largest probability t (to float precision, at most `high`) whose
    tokens p >= t hold at least top_p: BISECTION_STEPS halvings of [0, high], on the device."""
    lo, hi = torch.zeros_like(high)[:, None], high[:, None].clone()
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        enough = (probs * (probs >= mid)).sum(-1, keepdim=True) >= top_p[:, None]
        lo, hi = torch.where(enough, mid, lo), torch.where(enough, hi, mid)
    return lo


def exponential(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Exp(1) noise shaped like `probs`, as -log(U) (torch's own exponential_ is 4-5x slower on
    the CPU): rows of seeded sequences from their own generators (made on this device at their
    first draw), the rest from torch's."""
    uniform = torch.rand_like(probs)
    for i, seq in enumerate(seqs):
        if seq.params.seed is not None:
            uniform[i] = torch.rand(
                probs.shape[-1], generator=_generator(seq, probs.device), device=probs.device
            )
    return uniform.log_().neg_()


def _generator(seq: Sequence, device: torch.device) -> torch.Generator:
    assert seq.params.seed is not None  # only seeded sequences draw from their own
    if seq.generator is None or seq.generator.device != device:  # first draw (or a new device)
        seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
    return seq.generator
