"""The test block of the lookup-error recipes (int8_digits_error.py, popc_decode_error.py), and
the table they print. W is a rows x cols block whose rows are quantized to 2^b non-uniform levels
(the row's quantiles); x is tokens of N(0, 1) activations with 8 outlier channels scaled by
`outlier`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def lut_block(rng, bits: int, outlier: float, rows=256, cols=14336, tokens=4):
    """(levels [rows, 2^bits], label [rows, cols], x [tokens, cols])."""
    w = rng.standard_normal((rows, cols)) * 0.02
    levels = np.quantile(w, (np.arange(2**bits) + 0.5) / 2**bits, axis=1).T
    label = np.abs(w[:, :, None] - levels[:, None, :]).argmin(-1)
    x = rng.standard_normal((tokens, cols))
    x[:, rng.choice(cols, 8, replace=False)] *= outlier
    return levels, label, x


def relative_errors(ref: np.ndarray, ys: list[np.ndarray]) -> list[float]:
    return [float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) for y in ys]


def print_error_table(errors: Callable, columns: list[str], widths: tuple[int, ...]) -> None:
    """One markdown row per (bits, outlier): errors(rng, bits, outlier) under `columns`."""
    rng = np.random.default_rng(0)
    print("| bits | outlier x | " + " | ".join(columns) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in columns) + " |")
    for bits in widths:
        for outlier in (1.0, 50.0, 300.0):
            e = errors(rng, bits, outlier)
            print(f"| {bits} | {outlier:g} | " + " | ".join(f"{v:.1e}" for v in e) + " |")
