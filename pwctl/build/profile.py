"""`pwctl profile`: what each demotion costs, measured offline on calibration text.

For every block and width b (the rest at the parent width) the damage is the increase of KL to
the fp16 reference per token (`measured`: one forward pass per block and width), or a proxy from
one pass: the router-weighted squared error of the expert's output with only that block at b,
sum_t w_t^2 ||y_b(x_t) - y(x_t)||^2 per token (`proxy`). Damage is kept per sequence too, with
three input-norm features per layer and sequence for fit-residual, and the router's load per
expert. Results live in the pack as profile.safetensors + profile.json (written atomically;
the JSON carries the tensor file's CRC).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.format.profile import FEATURES, Profile
from pwctl.policy import parse_policy
from pwctl.runtime.moe.activation import expert_mlp
from pwctl.runtime.moe.block import MoETap
from pwctl.text import norm_features

if TYPE_CHECKING:
    from pwctl.runtime.engine.engine import Engine

METHODS = ("measured", "proxy")


def _kl_per_seq(ref: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, -1)
    return (ref.exp() * (ref - lp)).sum(-1).mean(-1)


def run_profile(engine: Engine, ids: torch.Tensor, method: str, progress=None) -> Profile:
    if method not in METHODS:
        raise PwctlError(f"--method must be one of {METHODS}")
    if engine.paged is not None:  # the sweeps below set single blocks' widths in the store
        raise PwctlError("profile runs on the store experts: Engine(..., experts='store')")
    t0 = time.perf_counter()
    pack, store = engine.pack, engine.store
    m = pack.manifest
    widths = list(range(m.min_bits, m.max_bits + 1))
    n_seq, seq_len = ids.shape
    store.plan.set(m.max_bits)
    with MoETap(engine.model) as tap:
        base_logits = engine.logits(ids)
    features, share = _features(engine, tap, n_seq, seq_len)
    proxy_seq = _proxy(engine, tap, widths, n_seq, seq_len, progress if method == "proxy" else None)
    meta: dict[str, Any] = {
        "method": method,
        "samples": n_seq,
        "seq_len": seq_len,
        "tokens": n_seq * seq_len,
        "features": list(FEATURES),
        "blocks": [b.name for b in pack.blocks],
        "bytes": [[b.bytes_at(w) for w in widths] for b in pack.blocks],
    }
    if method == "proxy":
        damage_seq = proxy_seq
        proxy = None
    else:
        store.apply(parse_policy("fp16"))
        ref = torch.log_softmax(engine.logits(ids), -1)
        store.plan.set(m.max_bits)
        base = _kl_per_seq(ref, base_logits)
        damage_seq = np.zeros((len(pack.blocks), len(widths), n_seq))
        for i in range(len(pack.blocks)):
            for wi, w in enumerate(widths[:-1]):
                store.plan.set(w, i)
                damage_seq[i, wi] = (_kl_per_seq(ref, engine.logits(ids)) - base).cpu().numpy()
            store.plan.set(m.max_bits, i)
            if progress:
                progress(i + 1, len(pack.blocks))
        meta["baseline_kl"] = float(base.mean())
        proxy = proxy_seq.mean(-1)
        meta["spearman_proxy_vs_measured"] = _spearman(proxy[:, :-1], damage_seq.mean(-1)[:, :-1])
    meta["seconds"] = time.perf_counter() - t0
    return Profile(widths, damage_seq.mean(-1), damage_seq, features, share, meta, proxy)


def _features(engine: Engine, tap: MoETap, n_seq: int, seq_len: int):
    layers = engine.pack.manifest.moe_layers
    spec = engine.pack.manifest.spec
    feats = np.zeros((len(layers), n_seq, 3))
    share = np.zeros((len(layers), spec["num_experts"]))
    for li, layer in enumerate(layers):
        x, index, _ = tap.seen[layer]
        feats[li] = norm_features(x.view(n_seq, seq_len, -1)).cpu().numpy()
        counts = torch.bincount(index.flatten(), minlength=spec["num_experts"]).cpu().numpy()
        share[li] = counts / counts.sum()
    return feats, share


@torch.no_grad()  # the model's own parameters (GPT-OSS's expert biases) would record a graph
def _proxy(
    engine: Engine, tap: MoETap, widths: list[int], n_seq: int, seq_len: int, progress
) -> np.ndarray:
    """Per block and width: sum over routed tokens of w^2 ||y_b - y||^2 per token, where y is
    the expert's output and y_b the same with only this block at width b (one pass, no
    full-model forward per block)."""
    pack, store = engine.pack, engine.store
    out = np.zeros((len(pack.blocks), len(widths), n_seq))
    top = widths[-1]
    biases = {m.layer: m.bias() for m in tap.blocks}  # GPT-OSS's routed experts' biases
    for n, block in enumerate(pack.blocks):
        if block.proj != "gate":
            continue  # one pass per expert handles its three blocks
        x, index, weights = tap.seen[block.layer]
        x = tap.dense_seen.get(block.layer, x) if block.shared else x  # a dense MLP's own input
        if block.shared:
            tokens = torch.arange(x.shape[0], device=x.device)
            w = torch.ones(x.shape[0], device=x.device)
        else:
            tokens, slot = torch.where(index == block.expert)
            w = weights[tokens, slot]
        if tokens.numel() == 0:
            continue
        inp, seq = x[tokens], (tokens // seq_len).cpu()
        ids = {p: pack.index[(block.layer, block.expert, p)] for p in ("gate", "up", "down")}
        full = {p: store.weight_at(j, top) for p, j in ids.items()}

        bias = biases[block.layer]
        eb = None if bias is None or block.shared else bias.of(block.expert)

        def expert(wts, inp=inp, eb=eb):
            return expert_mlp(inp, wts["gate"], wts["up"], wts["down"], store.glu, eb)

        y = expert(full)
        for p, j in ids.items():
            for wi, b in enumerate(widths[:-1]):
                err = ((expert({**full, p: store.weight_at(j, b)}) - y) ** 2).sum(-1)
                err = (err * w.float() ** 2).float().cpu()
                out[j, wi] = torch.zeros(n_seq).index_add_(0, seq, err).numpy() / seq_len
        if progress:
            progress(n + 3, len(pack.blocks))
    return out


def _spearman(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    from scipy.stats import spearmanr

    overall = float(spearmanr(a.ravel(), b.ravel()).statistic)
    per_width = [float(spearmanr(a[:, j], b[:, j]).statistic) for j in range(a.shape[1])]
    return {"overall": overall, "within_width_mean": float(np.nanmean(per_width))}
