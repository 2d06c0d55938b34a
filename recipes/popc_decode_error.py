"""CPU experiment behind docs/KERNELS.md's next step "the binary tensor-core dot product": y = W x
computed the way a binary tensor-core kernel (mma.m16n8k256 .b1 .and.popc) would, against the
fp16 operands the kernels use now. A row's table T (2^b fp16 levels) is written in the
multilinear basis of its label bits, T[v] = sum over plane subsets A of c_A * prod_{j in A}
bit_j(v) (c_A: Moebius sums of T, in fp32), so y = sum_A c_A * (M_A . x) with M_A the AND of the
planes in A (a bit mask: no lookup). x is `xbits`-bit two's-complement fixed point with a
per-token scale; M_A . x_int is what the popcounts of M_A & (bit plane i of x_int), weighted 2^i,
add up to: an exact integer. The fp32 combine follows the kernel's order. The block:
`lut_block.py`. Usage: python3 recipes/popc_decode_error.py"""

from __future__ import annotations

import itertools

import numpy as np
from lut_block import lut_block, print_error_table, relative_errors


def subset_coefficients(levels: np.ndarray, bits: int) -> dict[tuple[int, ...], np.ndarray]:
    """c_A per row (fp32) for every subset A of planes (plane 0 = the label's top bit)."""
    out = {}
    for n in range(bits + 1):
        for subset in itertools.combinations(range(bits), n):
            c = np.zeros(levels.shape[0], dtype=np.float64)
            for m in range(n + 1):
                for sub in itertools.combinations(subset, m):
                    label = sum(1 << (bits - 1 - j) for j in sub)
                    c += (-1) ** (n - m) * levels[:, label].astype(np.float64)
            out[subset] = c.astype(np.float32)
    return out


def popc_matvec(levels16, label, bits, x, xbits) -> np.ndarray:
    limit = 2 ** (xbits - 1) - 1
    sx = (np.abs(x).max(1, keepdims=True) / limit).astype(np.float32)
    xi = np.round(x / sx).astype(np.int64)  # [tokens, cols]
    planes = [((label >> (bits - 1 - j)) & 1).astype(np.int64) for j in range(bits)]
    y = np.zeros((label.shape[0], x.shape[0]), dtype=np.float32)
    for subset, c in subset_coefficients(levels16, bits).items():
        mask = np.ones_like(label, dtype=np.int64)
        for j in subset:
            mask &= planes[j]
        d = mask @ xi.T  # exact: what the popcounts add up to
        y += c[:, None] * d.astype(np.float32)
    return y * sx.T


def errors(rng, bits: int, outlier: float) -> list[float]:
    levels, label, x = lut_block(rng, bits, outlier)
    levels16 = levels.astype(np.float16)
    wq = np.take_along_axis(levels16.astype(np.float64), label, 1)
    ref = wq @ x.T
    fp16 = wq @ x.astype(np.float16).astype(np.float64).T
    got = [fp16] + [popc_matvec(levels16, label, bits, x, xb).astype(np.float64) for xb in (12, 16)]
    return relative_errors(ref, got)


def main() -> None:
    print_error_table(errors, ["fp16", "popc, 12-bit x", "popc, 16-bit x"], (2, 3, 4))


if __name__ == "__main__":
    main()
