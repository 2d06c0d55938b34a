"""CPU experiment behind docs/KERNELS.md's "int8 digits" next step: the error of y = W x when
the looked-up weights and the activations are 16-bit fixed point split into two signed int8
digits (per-row / per-token scale; what mma.m16n8k32.s8 would multiply), against the fp16 operands
the kernels use now. W: a 256 x 14336 block, each row quantized to 2^b non-uniform levels (its
quantiles); x: 4 tokens, N(0, 1) with 8 outlier channels scaled by `outlier`.
Usage: python3 recipes/int8_digits_error.py"""

from __future__ import annotations

import numpy as np

LIMIT = 32639  # largest |value| whose high digit, rounded, still fits int8


def digits(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hi = (v + 128) >> 8
    return hi, v - 256 * hi  # both in [-128, 127]


def errors(rng, bits: int, outlier: float, rows=256, cols=14336, tokens=4) -> list[float]:
    w = rng.standard_normal((rows, cols)) * 0.02
    levels = np.quantile(w, (np.arange(2**bits) + 0.5) / 2**bits, axis=1).T
    label = np.abs(w[:, :, None] - levels[:, None, :]).argmin(-1)
    wq = np.take_along_axis(levels, label, 1)
    x = rng.standard_normal((tokens, cols))
    x[:, rng.choice(cols, 8, replace=False)] *= outlier
    ref = wq @ x.T
    fp16 = wq.astype(np.float16).astype(np.float64) @ x.astype(np.float16).astype(np.float64).T
    sw = np.abs(levels).max(1, keepdims=True) / LIMIT
    sx = np.abs(x).max(1, keepdims=True) / LIMIT
    wh, wl = digits(np.take_along_axis(np.round(levels / sw).astype(np.int64), label, 1))
    xh, xl = digits(np.round(x / sx).astype(np.int64))
    scale = sw * sx.T
    three = (65536.0 * (wh @ xh.T) + 256.0 * (wh @ xl.T + wl @ xh.T)) * scale
    four = three + (wl @ xl.T) * scale
    return [float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) for y in (fp16, three, four)]


def main() -> None:
    rng = np.random.default_rng(0)
    print("| bits | outlier x | fp16 | int8 digits, 3 mma | int8 digits, 4 mma |")
    print("| --- | --- | --- | --- | --- |")
    for bits in (3, 4, 8):
        for outlier in (1.0, 50.0, 300.0):
            e = errors(rng, bits, outlier)
            print(f"| {bits} | {outlier:g} | " + " | ".join(f"{v:.1e}" for v in e) + " |")


if __name__ == "__main__":
    main()
