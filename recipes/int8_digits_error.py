"""CPU experiment behind the int8-digit lookup (branch `decode-int8`; docs/KERNELS.md, "What was
tried"): the error of y = W x when the looked-up weights and the activations are 16-bit fixed
point split into two signed int8 digits (per-row / per-token scale; what mma.m16n8k32.s8 would
multiply), against the fp16 operands the kernels use now. The block: `lut_block.py`.
Usage: python3 recipes/int8_digits_error.py"""

from __future__ import annotations

import numpy as np
from lut_block import lut_block, print_error_table, relative_errors

LIMIT = 32639  # largest |value| whose high digit, rounded, still fits int8


def digits(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hi = (v + 128) >> 8
    return hi, v - 256 * hi  # both in [-128, 127]


def errors(rng, bits: int, outlier: float) -> list[float]:
    levels, label, x = lut_block(rng, bits, outlier)
    wq = np.take_along_axis(levels, label, 1)
    ref = wq @ x.T
    fp16 = wq.astype(np.float16).astype(np.float64) @ x.astype(np.float16).astype(np.float64).T
    sw = np.abs(levels).max(1, keepdims=True) / LIMIT
    sx = np.abs(x).max(1, keepdims=True) / LIMIT
    wh, wl = digits(np.take_along_axis(np.round(levels / sw).astype(np.int64), label, 1))
    xh, xl = digits(np.round(x / sx).astype(np.int64))
    scale = sw * sx.T
    three = (65536.0 * (wh @ xh.T) + 256.0 * (wh @ xl.T + wl @ xh.T)) * scale
    four = three + (wl @ xl.T) * scale
    return relative_errors(ref, [fp16, three, four])


def main() -> None:
    columns = ["fp16", "int8 digits, 3 mma", "int8 digits, 4 mma"]
    print_error_table(errors, columns, (3, 4, 8))


if __name__ == "__main__":
    main()
