"""Where the kernels read their operands: a projection's static layout (`Proj`), activations in
mma-fragment order (decode, mma.sync prefill) and in wgmma order with the sm_90a prefill's token
tiles and their plan (`TilePlan`), and the stream-K split of the prefill down (`down_spans`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pwctl.format import bitplanes
from pwctl.kernels import geometry, launch
from pwctl.runtime.moe.pairs import Pairs, all_tokens


@dataclass(frozen=True)
class Proj:
    """Static layout of one projection of a layer (all experts of the layer share it)."""

    rows: int
    cols: int
    words: int
    rows_per_table: int

    @property
    def bits_nbytes(self) -> int:
        return bitplanes.bits_nbytes(self.rows, self.words)

    @property
    def wpad(self) -> int:
        """Plane words per row as the kernels' activation layout holds them (a multiple of 8)."""
        return -(-self.words // 8) * 8


@functools.lru_cache(maxsize=256)  # bounded: prefill meets every prompt length
def one_slot_tiles(T: int, device: torch.device) -> torch.Tensor:
    """The token tiles of one slot of T pairs (`all_tokens`): `tile_plan`'s, made once per T."""
    return tile_plan(all_tokens(T, None, 0, device)).info


def fragment_order(x: torch.Tensor, wpad: int) -> torch.Tensor:
    """[n, K] -> float16 [n, wpad, 32] (the kernels' activation layout, cuda/common.cuh),
    zero-padded to 32*wpad columns: [n, w, 4s + i] holds column 32w + s // 2 + 16 (s % 2) + 4i.
    View ops only (no index tensor), so CUDA-graph capture works."""
    # column 32w + 16h + 4i + c, stored as [w][c][h][i] (k-step s = 2c + h)
    n = x.shape[0]
    return _half_padded(x, wpad).view(n, wpad, 2, 4, 4).permute(0, 1, 4, 2, 3).reshape(n, wpad, 32)


def _half_padded(x: torch.Tensor, wpad: int) -> torch.Tensor:
    """x in fp16 with zero columns up to 32 * wpad (the kernels' activation width)."""
    xh = x.half()
    return F.pad(xh, (0, 32 * wpad - x.shape[1])) if 32 * wpad > x.shape[1] else xh


TILE_TOKENS = geometry.PREFILL_TOKENS  # tokens of an sm_90a prefill tile (prefill_wg.cu WG_TOKENS)


def wgmma_order(x: torch.Tensor, wpad: int) -> torch.Tensor:
    """[n, K] -> float16 [n, 32 * wpad], zero-padded, columns in the order the sm_90a prefill's
    lanes hold their weights: per 256-column chunk `it` and k-step s (0..15), the 16 columns of
    the step, so one token's k-step is 32 contiguous bytes. Position 256 it + 16 s + k holds
    column 32 w + c + 16 h + 4 j with w = 8 it + 2 (k % 8 // 2) + s // 8, c = s // 2 % 4,
    h = s % 2, j = k % 2 + 2 (k // 8)."""
    return _half_padded(x, wpad)[:, _wgmma_columns(wpad, x.device)]


@functools.cache
def _wgmma_columns(wpad: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(32 * wpad)
    it, s, k = pos // 256, pos // 16 % 16, pos % 16
    w = 8 * it + 2 * (k % 8 // 2) + s // 8
    return (32 * w + s // 2 % 4 + 16 * (s % 2) + 4 * (k % 2 + 2 * (k // 8))).to(device)


def wgmma_tiles(x: torch.Tensor, wpad: int, rows: torch.Tensor) -> torch.Tensor:
    """Token tiles for the sm_90a prefill: rows [tiles * 128] of x, in wgmma order, each tile
    laid out as the kernel's shared memory holds it (cuda/prefill_wg.cu `tile_pos`): per
    half-chunk of 128 positions, [k-step 8][token group 16][k 0-7 / 8-15][token 8][8 values]."""
    xw = wgmma_order(x, wpad)[rows]
    tiles, hc = rows.numel() // TILE_TOKENS, 32 * wpad // 128
    return xw.view(tiles, 16, 8, hc, 8, 2, 8).permute(0, 3, 4, 1, 5, 2, 6).contiguous()


@dataclass
class TilePlan:
    """The sm_90a prefill's token tiles: one per (slot, pass), each slot's tiles consecutive. The
    tile count is a bound known from shapes (pairs / 128 + slots), so planning needs no host sync;
    tiles past the last real one have slot -1 and their CTAs exit at once. The bound exceeds the
    live tiles, so a plan ends with a dead tile; a dead tile's pass is the count of live tiles
    (cuda/prefill_wg.cu down_span reads it from the last)."""

    info: torch.Tensor  # int32 [tiles, 2]: (slot, pass) of each tile
    pair: torch.Tensor  # int64 [tiles * 128]: pair of each tile token (past a slot's end: its last)

    @property
    def tiles(self) -> int:
        return self.info.shape[0]


def tile_bound(pairs: int, slots: int) -> int:
    """Token tiles a prefill plans for (no host sync: from shapes): each slot's last tile may be
    partial."""
    return -(-pairs // TILE_TOKENS) + slots


def tile_plan(pairs: Pairs) -> TilePlan:
    """Tiles of 128 consecutive pairs of one slot, from device tensors only (no host sync). The
    reference for `prepare_prefill`'s plan (cuda/prep.cu `plan_tiles`) and `token_tiles`."""
    lo, hi = pairs.lo.long(), pairs.hi.long()
    per = (hi - lo).clamp(min=0).add(TILE_TOKENS - 1).div(TILE_TOKENS, rounding_mode="floor")
    end = per.cumsum(0)
    bound = tile_bound(pairs.token.numel(), per.numel())
    tile = torch.arange(bound, device=lo.device)
    slot = torch.searchsorted(end, tile, right=True).clamp(max=per.numel() - 1)
    pas = tile - (end - per)[slot]
    pair = lo[slot, None] + TILE_TOKENS * pas[:, None] + torch.arange(TILE_TOKENS, device=lo.device)
    pair = torch.minimum(pair, hi[slot, None] - 1).clamp(min=0).reshape(-1)
    live = tile < end[-1]
    info = torch.stack([torch.where(live, slot, -1), torch.where(live, pas, end[-1])], 1)
    info = info.to(torch.int32)
    return TilePlan(info, pair)


def down_spans(units: int, sk: int, chunks: int) -> list[tuple[int, int]]:
    """CPU twin of cuda/prefill_wg.cu `down_span` on its stream-K wave (sk > 0 CTAs): each CTA's
    range of chunks, in unit order, of `units` live units of `chunks` chunks. CTAs b < D =
    (units / sk) sk take unit b whole; the next sk CTAs equal shares of the rest (at most half a
    unit each) if it fills at most half a wave, else whole units too (then D = units and the
    shares are empty)."""
    d = units if 2 * (units % sk) > sk else units // sk * sk
    whole = [(b * chunks, (b + 1) * chunks) for b in range(d)]
    rest = (units - d) * chunks
    shares = [d * chunks + j * rest // sk for j in range(sk + 1)]
    return whole + list(zip(shares, shares[1:], strict=False))


def token_tiles(
    x: torch.Tensor, wpad: int, pairs: Pairs, info: torch.Tensor, kernel: str = "token_tiles"
) -> torch.Tensor:
    """`wgmma_tiles(x, wpad, pairs.token[tile_plan(pairs).pair])` in one launch (CUDA), flat
    [tiles, 128 * 32 * wpad], for the tiles `info` plans (`tile_plan(pairs).info`). Tiles past
    the last real one (slot -1) are left unwritten: no kernel reads them. `kernel`: its launch
    name in the model's build (`registry.qualified`: the module its prefill kernels are in)."""
    xh = x.half().contiguous()
    tiles = info.shape[0]
    xt = torch.empty(tiles, TILE_TOKENS * 32 * wpad, dtype=torch.float16, device=x.device)
    units = wpad // 4 * 2048  # 16-byte units a tile (cuda/prefill_wg.cu token_tiles)
    p, i = launch.ptr, np.int32
    launch.launch(
        kernel,
        (min(64, -(-units // 256)), tiles),
        (256,),
        (p(xh), i(x.shape[1]), i(wpad), p(pairs.token), p(pairs.lo), p(pairs.hi), p(info), p(xt)),
    )
    return xt
