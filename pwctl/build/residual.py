"""`pwctl fit-residual`: how far one sequence's damage departs from the average, predicted from
three input-norm features of that sequence at the block's layer (mean, max and standard deviation
of the token L2 norms at the MoE input; see docs/RUNTIME.md).

Target: log(damage_seq / damage_mean) per (block, width, sequence). One ridge regression per MoE
layer on standardised features, fitted with scikit-learn; coefficients are stored as plain JSON
(residual.json in the pack), never pickled. Sequences, not samples, are split train / test so
that no test sequence is seen in training."""

from __future__ import annotations

import numpy as np

from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.format.profile import FEATURES, Profile
from pwctl.format.residual import ResidualModel

FLOOR = 1e-3  # relative floor under per-sequence damage, so log ratios stay finite


def _samples(profile: Profile, block_layers: np.ndarray, seqs: np.ndarray):
    """Rows (layer index, features, log ratio, mean damage, actual damage, group id)."""
    mean = profile.damage[:, :-1]
    floor = FLOOR * np.median(mean[mean > 0]) if (mean > 0).any() else 1e-12
    rows = []
    for i in range(mean.shape[0]):
        for w in range(mean.shape[1]):
            if mean[i, w] <= floor:
                continue  # below the noise floor: nothing to correct
            d = np.maximum(profile.damage_seq[i, w, seqs], floor)
            y = np.log(d / mean[i, w])
            for k, s in enumerate(seqs):
                li = block_layers[i]
                rows.append((li, profile.features[li, s], y[k], mean[i, w], d[k], i * 64 + w))
    if not rows:
        raise PwctlError("profile has no damage above its noise floor; nothing to fit")
    li, f, y, m, d, g = zip(*rows, strict=True)
    return np.array(li), np.array(f), np.array(y), np.array(m), np.array(d), np.array(g)


def fit(pack: Pack, test_split: float = 0.2, seed: int = 0, alpha: float = 1.0) -> ResidualModel:
    from scipy.stats import spearmanr
    from sklearn.linear_model import Ridge
    from sklearn.metrics import r2_score

    if not 0 < test_split < 1:
        raise PwctlError("--test-split must be in (0, 1)")
    profile = Profile.load(pack)
    layers = pack.manifest.moe_layers
    block_layers = np.array([layers.index(b.layer) for b in pack.blocks])
    n_seq = profile.damage_seq.shape[2]
    n_test = int(round(n_seq * test_split))
    if n_seq < 4 or n_test < 1 or n_test >= n_seq:
        raise PwctlError(
            f"profile has {n_seq} sequences: too few to split for testing "
            "(run profile with --samples 8 or more)"
        )
    order = np.random.default_rng(seed).permutation(n_seq)
    test, train = order[:n_test], order[n_test:]
    li_tr, f_tr, y_tr, _, _, _ = _samples(profile, block_layers, train)
    li_te, f_te, y_te, m_te, d_te, g_te = _samples(profile, block_layers, test)
    mean, scale = f_tr.mean(0), f_tr.std(0) + 1e-12
    coef, intercept, pred = [], [], np.zeros_like(y_te)
    for li in range(len(layers)):
        sel = li_tr == li
        model = Ridge(alpha=alpha).fit((f_tr[sel] - mean) / scale, y_tr[sel]) if sel.any() else None
        coef.append([0.0] * 3 if model is None else model.coef_.tolist())
        intercept.append(0.0 if model is None else float(model.intercept_))
        te = li_te == li
        if te.any() and model is not None:
            pred[te] = model.predict((f_te[te] - mean) / scale)
    within = []
    for g in np.unique(g_te):
        sel = g_te == g
        if sel.sum() >= 3 and np.ptp(d_te[sel]) > 0:
            within.append(spearmanr(pred[sel], d_te[sel]).statistic)
    metrics = {
        "train_samples": int(len(y_tr)),
        "test_samples": int(len(y_te)),
        "test_sequences": int(n_test),
        "features": list(FEATURES),
        "r2_test": float(r2_score(y_te, pred)),
        "r2_test_average_only": float(r2_score(y_te, np.zeros_like(y_te))),
        "spearman_test": float(spearmanr(m_te * np.exp(pred), d_te).statistic),
        "spearman_test_average_only": float(spearmanr(m_te, d_te).statistic),
        "spearman_within_block_width": float(np.nanmean(within)) if within else float("nan"),
    }
    return ResidualModel(layers, mean.tolist(), scale.tolist(), coef, intercept, metrics)
