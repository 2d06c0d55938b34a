"""`pwctl bench --ppl`: perplexity and mean KL to the fp16 reference, per policy, on one text."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pwctl.errors import PwctlError
from pwctl.policy import Policy, parse_policy
from pwctl.runtime.engine import Engine


@dataclass
class PplResult:
    policy: str
    expert_mb: float
    bits_per_weight: float
    ppl: float
    kl: float  # mean KL(fp16 || policy) in nats per token
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def token_windows(engine: Engine, path: Path, seq_len: int, max_tokens: int) -> torch.Tensor:
    if not path.is_file():
        raise PwctlError(f"{path}: data file not found")
    text = path.read_text(errors="replace")
    if not text.strip():
        raise PwctlError(f"{path}: data file is empty")
    ids = engine.tokenizer(text, return_tensors="pt").input_ids[0][:max_tokens]
    n = ids.numel() // seq_len
    if n == 0:
        raise PwctlError(f"{path}: {ids.numel()} tokens, fewer than one window of {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


def run_ppl(engine: Engine, windows: torch.Tensor, policies: list[Policy]) -> list[PplResult]:
    """Windows outer, policies inner: the fp16 log-probs of one window are all KL needs."""
    fp16 = parse_policy("fp16")
    nll = {str(p): 0.0 for p in policies}
    kl = {str(p): 0.0 for p in policies}
    count = 0
    for w in windows:
        ids, target = w[None], w[1:]
        engine.set_policy(fp16)
        ref = torch.log_softmax(engine.logits(ids)[0, :-1], -1)
        for p in policies:
            engine.set_policy(p)
            lp = ref if p.name == "fp16" else torch.log_softmax(engine.logits(ids)[0, :-1], -1)
            nll[str(p)] -= lp.gather(1, target[:, None].to(lp.device)).sum().item()
            kl[str(p)] += (ref.exp() * (ref - lp)).sum().item()
        count += target.numel()
    weights = sum(b.rows * b.cols for b in engine.pack.blocks)
    out = []
    for p in policies:
        engine.set_policy(p)
        nbytes = engine.store.expert_bytes()
        out.append(
            PplResult(
                str(p),
                nbytes / 1e6,
                nbytes * 8 / weights,
                math.exp(nll[str(p)] / count),
                kl[str(p)] / count,
                count,
            )
        )
    return out
