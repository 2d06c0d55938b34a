"""CPU twin of the one-token decode kernels on binary tensor cores (cuda/popc.cu `gate_up_p1`,
`down_p1`): the same arithmetic in torch, for the tests to hold the kernels' algebra and column
order to the lookup reference.

A row's table T (2^b levels, indexed by the label whose bit b-1-p is plane p) is rewritten in the
multilinear basis of the planes: T[label] = sum over plane subsets S of c_S * prod_{p in S} bit_p,
with c_S the Moebius sums of T (`subset_coefficients`). Then

    y[r] = sum_S c_S[r] * (AND of row r's planes in S) . x

and with x as 16-bit two's-complement fixed point q = round(x / sx), every (AND_S) . q is an
exact integer (what mma .and.popc adds up over q's bit planes). The kernels quantize x per piece
of at most `POPC_STEPS` k-steps of 256 columns, each piece with its own scale; `step_words`
gives which words (32 columns each) a k-step holds."""

from __future__ import annotations

import torch

from pwctl.kernels.geometry import POPC_STEPS

Q_MAX = 32767  # 16-bit two's complement


def steps(words: int) -> int:
    """k-steps of a row of `words` words (words % 4 == 0; cuda/pieces.cuh popc_steps)."""
    return 2 * (words // 16) + -(-(words % 16) // 8)


def pieces(words: int) -> int:
    """PopcX pieces of a row (cuda/pieces.cuh popc_pieces)."""
    return -(-steps(words) // POPC_STEPS)


def subset_coefficients(table: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, 2^bits] levels -> [rows, 2^bits] float64 c_S; bit p of S is plane p (label bit
    bits-1-p). c_{} = T[0], and sum_{S within the label's planes} c_S = T[label]."""
    S = torch.arange(1 << bits)
    label = torch.zeros_like(S)
    for p in range(bits):
        label |= ((S >> p) & 1) << (bits - 1 - p)
    c = table.double()[:, label].clone()
    for p in range(bits):  # Moebius transform, one plane at a time
        has = ((S >> p) & 1).bool()
        c[:, has] -= c[:, S[has] ^ (1 << p)]
    return c


def step_words(words: int) -> list[list[int]]:
    """The words of each k-step of a row of `words` words (words % 4 == 0): full 16-word chunks
    first, two k-steps each (lane t holds words 16c + 4t + 2s, + 1 in step 2c + s), then 8-word
    k-steps (lane t: words 8j + 2t, + 1); words past the row are dropped."""
    chunks = words // 16
    out = []
    for c in range(chunks):
        for s in range(2):
            out.append([16 * c + 4 * t + 2 * s + h for t in range(4) for h in range(2)])
    for base in range(16 * chunks, words, 8):
        out.append([w for w in range(base, base + 8) if w < words])
    return out


def scale_of(x: torch.Tensor) -> float:
    """A piece's scale sx = max|x| / 32767 (0 for an all-zero piece)."""
    return float(x.abs().max()) / Q_MAX


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """fp32 x -> (int64 q, scale sx) as `popc_planes` does it."""
    sx = scale_of(x)
    return quantize_with(x, sx), sx


def quantize_with(x: torch.Tensor, sx: float) -> torch.Tensor:
    """q = rn(x * (32767 / max|x|)) in fp32 for a piece whose scale is sx (0: all zeros)."""
    if sx == 0:
        return torch.zeros_like(x, dtype=torch.int64)
    inv = torch.tensor(Q_MAX, dtype=torch.float32) / torch.tensor(sx * Q_MAX, dtype=torch.float32)
    return torch.round(x.float() * inv).to(torch.int64)


def popc_matvec(
    labels: torch.Tensor,
    table: torch.Tensor,
    bits: int,
    x: torch.Tensor,
    span: tuple[int, int] | None = None,
) -> torch.Tensor:
    """y = W x for W[r, j] = table[r, labels[r, j]] (x: fp16 values, [cols]) over the k-steps
    [lo, hi) of `span` (all by default: down's k-split takes slices), as the kernels compute it.
    Piece i holds k-steps [32 i, 32 i + 32) and is quantized with its own scale (`popc_planes`),
    whatever part of it a slice uses; exact integer subset dot products; fp64 sums."""
    rows, cols = labels.shape
    words = step_words(-(-cols // 32))
    lo, hi = span if span is not None else (0, len(words))
    coef = subset_coefficients(table, bits)
    planes = [(labels >> (bits - 1 - p)) & 1 for p in range(bits)]

    def columns(k0: int, k1: int) -> torch.Tensor:
        spans = [torch.arange(32 * w, min(32 * w + 32, cols)) for ws in words[k0:k1] for w in ws]
        return torch.cat(spans)

    y = torch.zeros(rows, dtype=torch.float64)
    for base in range(lo - lo % POPC_STEPS, hi, POPC_STEPS):
        sx = scale_of(x.float()[columns(base, base + POPC_STEPS)])
        col = columns(max(lo, base), min(hi, base + POPC_STEPS))
        q = quantize_with(x.float()[col], sx)
        acc = coef[:, 0] * q.sum().double()
        for S in range(1, 1 << bits):
            mask = torch.ones(rows, col.numel(), dtype=torch.int64)
            for p in range(bits):
                if S >> p & 1:
                    mask &= planes[p][:, col]
            acc += coef[:, S] * (mask @ q).double()  # exact: what the popcounts add up to
        y += sx * acc
    return y
