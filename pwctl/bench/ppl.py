"""`pwctl bench --ppl`: perplexity and mean KL to the fp16 reference, per policy, on one text."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from pwctl.policy import Policy, parse_policy
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.moe.block import DenseMLP, MoEBlock, MoETap


@dataclass
class PplResult:
    policy: str
    expert_mb: float
    bits_per_weight: float
    ppl: float
    kl: float  # mean KL(fp16 || policy) in nats per token
    # ||MoE_policy(x) - MoE_fp16(x)||^2 / ||MoE_fp16(x)||^2, same inputs x (a dense MLP made
    # of blocks, Gemma-4's, counts as part of its layer's MoE)
    moe_err: float
    tokens: int
    kl_ci: tuple[float, float] = (0.0, 0.0)  # bootstrap 95% interval over windows

    def as_dict(self) -> dict:
        return asdict(self)


def pressure_trace(n: int) -> np.ndarray:
    """KV demand over `n` steps as a share of its peak: sequences arrive, overlap, drain
    (a raised cosine, 0 -> 1 -> 0)."""
    return 0.5 - 0.5 * np.cos(np.linspace(0.0, 2 * np.pi, n)) if n > 1 else np.ones(1)


def bootstrap_ci(
    values: np.ndarray, weights: np.ndarray, draws: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% interval of the weighted mean, resampling windows (documents) with replacement."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(values), size=(draws, len(values)))
    means = (values[pick] * weights[pick]).sum(1) / weights[pick].sum(1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(lo), float(hi)


def run_ppl(
    engine: Engine, windows: torch.Tensor, policies: list[Policy], kv_peak: float = 0.0
) -> list[PplResult]:
    """Windows outer, policies inner: the fp16 log-probs and MoE outputs of one window are all
    KL and the MoE output error need. MoE blocks are re-run on the inputs the fp16 pass saw,
    so their error is the quantizer's alone, not compounded through earlier layers.

    Budgeted policies re-plan before every window from the windows already seen. With
    `kv_peak` > 0 the windows run under a pressure trace: the KV cache's demand rises and falls
    (`pressure_trace`), peaking at kv_peak x BUDGET; dynamic policies get the plane memory it
    leaves free (BUDGET at peak pressure), static ones keep BUDGET. Memory is averaged over
    windows, and KL carries a bootstrap interval over windows."""
    fp16 = parse_policy("fp16")
    engine.reset_policies()  # each run's dynamic policies start from the profile alone
    names = [str(p) for p in policies]
    nll = {n: np.zeros(len(windows)) for n in names}
    kl = {n: np.zeros(len(windows)) for n in names}
    err, nbytes, norm = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), 0.0
    headroom = kv_peak * (1 - pressure_trace(len(windows)))
    dense = [m for m in engine.model.modules() if isinstance(m, DenseMLP)]
    for i, w in enumerate(windows):
        ids, target = w[None], w[1:]
        engine.set_policy(fp16)
        with MoETap(engine.model) as tap:
            ref = torch.log_softmax(engine.logits(ids)[0, :-1], -1)
        # each block's input and routing (replayed: a router of its own, Gemma-4's, is not
        # the block's)
        blocks: list[tuple[MoEBlock | DenseMLP, tuple]] = [
            (b, tap.seen[b.layer]) for b in tap.blocks
        ]
        blocks += [(d, (tap.dense_seen[d.layer], None, None)) for d in dense]
        with torch.no_grad():
            ref_out = [b.moe(x, index, w) for b, (x, index, w) in blocks]
        norm += sum(float(y.pow(2).sum()) for y in ref_out)
        for p, name in zip(policies, names, strict=True):
            engine.set_policy(p, headroom=float(headroom[i]))
            nbytes[name] += engine.store.expert_bytes()
            with MoETap(engine.model) as seen:
                lp = torch.log_softmax(engine.logits(ids)[0, :-1], -1)
            engine.observe(seen)
            nll[name][i] = -lp.gather(1, target[:, None].to(lp.device)).sum().item()
            kl[name][i] = (ref.exp() * (ref - lp)).sum().item()
            with torch.no_grad():
                err[name] += sum(
                    float((b.moe(x, index, w) - y).pow(2).sum())
                    for (b, (x, index, w)), y in zip(blocks, ref_out, strict=True)
                )
    per_window = np.full(len(windows), windows.shape[1] - 1, dtype=np.float64)
    count = int(per_window.sum())
    weights = sum(b.rows * b.cols for b in engine.pack.blocks)
    out = []
    for name in names:
        mean_bytes = nbytes[name] / len(windows)
        out.append(
            PplResult(
                name,
                mean_bytes / 1e6,
                mean_bytes * 8 / weights,
                math.exp(nll[name].sum() / count),
                kl[name].sum() / count,
                err[name] / max(norm, 1e-30),
                count,
                bootstrap_ci(kl[name] / per_window, per_window),
            )
        )
    return out
