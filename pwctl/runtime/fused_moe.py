"""The experts of one MoE layer, computed from paged planes at per-block widths: grouping of
(token, expert) pairs by expert, then two tensor-core kernels (gate+up with SiLU(gate)*up, then
down with the weighted combine; the shared expert is two more) that decode labels straight into
mma fragments. Decode (<= 64 tokens) groups on the device and never syncs the host (CUDA graphs);
prefill groups with torch and decodes each weight chunk once into shared memory for up to 128
tokens a pass. One interface: on the CPU (or with `reference=True`) the same pairs are computed
with torch from `DeviceTable.weight` (the format code), which is what the kernels are tested
against. Routing itself (router GEMM, softmax/top-k) stays in MoEBlock: the same `route` for
every path."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from pwctl import bitplanes
from pwctl.kernels import build, geometry, launch, popc
from pwctl.kernels.geometry import ROUTE_LOADS, ROUTE_MAX_EXPERTS
from pwctl.recipe import MoESpec
from pwctl.runtime.device_table import DeviceTable
from pwctl.runtime.router import route


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


@dataclass
class Pairs:
    """(token, expert) pairs sorted by expert, and the slots (one per active expert) over them."""

    token: torch.Tensor  # int32 [pairs]
    weight: torch.Tensor  # float32 [pairs]
    expert: torch.Tensor  # int32 [slots]: expert of each slot (block_ids row)
    lo: torch.Tensor  # int32 [slots]
    hi: torch.Tensor  # int32 [slots]; hi == lo: empty slot

    def slot_args(self) -> tuple:
        p = launch.ptr
        return (p(self.expert), p(self.lo), p(self.hi), p(self.token), p(self.weight))

    def kernel_args(self, block_ids: torch.Tensor) -> tuple:
        return self.slot_args() + (launch.ptr(block_ids), np.int32(block_ids.shape[0]))


def sort_by_expert(
    index: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A routing result's (token, slot) pairs in expert order, without a host sync: the order
    into the flattened pairs, each expert's pair count and the running ends of those counts."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=index.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync (graph capture)
    return order, counts, counts.cumsum(0)


def group(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Pairs:
    """Pairs of a routing result, sorted by expert, without a host sync: the slot count is the
    bound min(E, T*k); slots past the number of active experts are empty."""
    T, k = index.shape
    order, counts, ends = sort_by_expert(index, num_experts)
    active = torch.argsort((counts == 0).to(torch.int8), stable=True)[: min(num_experts, T * k)]
    n_active = (counts > 0).sum()
    live = torch.arange(active.numel(), device=index.device) < n_active
    lo = torch.where(live, ends[active] - counts[active], 0)
    hi = torch.where(live, ends[active], 0)
    i32 = torch.int32
    return Pairs(
        token=(order // k).to(i32),
        weight=weights.reshape(-1)[order].float(),
        expert=active.to(i32),
        lo=lo.to(i32),
        hi=hi.to(i32),
    )


def pair_buffers(n: int, slots: int, device: torch.device) -> Pairs:
    """Uninitialized pairs and slots, for a prep launch to fill."""
    i32 = torch.int32
    return Pairs(
        token=torch.empty(n, dtype=i32, device=device),
        weight=torch.empty(n, dtype=torch.float32, device=device),
        expert=torch.empty(slots, dtype=i32, device=device),
        lo=torch.empty(slots, dtype=i32, device=device),
        hi=torch.empty(slots, dtype=i32, device=device),
    )


def decode_buffers(
    T: int, k: int, num_experts: int, wpad: int, device: torch.device
) -> tuple[Pairs, torch.Tensor]:
    """What `prepare_decode` fills for T tokens of top-k routing: pairs, slots, x in fragment
    order (uninitialized)."""
    pairs = pair_buffers(T * k, min(num_experts, T * k), device)
    return pairs, torch.empty(T, wpad, 32, dtype=torch.float16, device=device)


def prepare_prefill(
    index: torch.Tensor, weights: torch.Tensor, num_experts: int, out: torch.Tensor
) -> tuple[Pairs, torch.Tensor]:
    """One launch for what a prefill call needs before its kernels (CUDA): `group`'s pairs and
    slots, the token tiles' (slot, pass) (`tile_plan(pairs).info`; no host sync) and `out`
    zeroed. In torch these were ~30 small launches, and eager prefill waited on the host."""
    T, k = index.shape
    n, slots = T * k, min(num_experts, T * k)
    pairs = pair_buffers(n, slots, index.device)
    info = torch.empty(tile_bound(n, slots), 2, dtype=torch.int32, device=index.device)
    idx, w = index.to(torch.int64).contiguous(), weights.float().contiguous()
    blocks = 1 + min(2 * geometry.sm_count(), -(-out.numel() // (4 * geometry.PREP_THREADS)))
    p, i = launch.ptr, np.int32
    launch.launch(
        "prefill_prep",
        (blocks,),
        (geometry.PREP_THREADS,),
        (p(idx), p(w), i(n), i(k), i(num_experts), i(slots))
        + (p(pairs.token), p(pairs.weight), p(pairs.expert), p(pairs.lo), p(pairs.hi))
        + (p(info), i(info.shape[0]), p(out), np.int64(out.numel())),
        shared_mem=geometry.group_smem(num_experts, n),
    )
    return pairs, info


@dataclass(frozen=True)
class XPieces:
    """Where a prep launch writes T tokens' x pieces for the popc kernels (cuda/pieces.cuh
    `x_piece`): a buffer of popc.pieces(words) pieces a token, words = the gate rows' words.
    Made once and reused: the prep kernels' arguments are fixed with it."""

    buf: torch.Tensor | None  # None: no pieces (`_NO_X_PIECES`)
    args: tuple  # the prep kernels' trailing arguments: words, the buffer, `blocks`
    blocks: int  # prep blocks that build the pieces (POPC_SPLIT a piece and token)

    @classmethod
    def over(cls, buf: torch.Tensor, words: int, T: int) -> XPieces:
        """Pieces of T tokens of `words` words into `buf`."""
        blocks = popc.pieces(words) * T * geometry.POPC_SPLIT
        return cls(buf, (np.int32(words), launch.ptr(buf), np.int32(blocks)), blocks)


_NO_X_PIECES = XPieces(None, (np.int32(0), np.uint64(0), np.int32(0)), 0)


def prepare_decode(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    wpad: int,
    out: torch.Tensor,
    buffers: tuple[Pairs, torch.Tensor] | None = None,
    pieces: XPieces | None = None,
) -> tuple[Pairs, torch.Tensor]:
    """One launch for what a decode call needs before its kernels: `group`'s pairs and slots (no
    host sync), x in fragment order (`fragment_order(x, wpad)`), `out` (float32) zeroed and,
    when given, x's `pieces`. Into `buffers` (`decode_buffers`) when given, else into new ones."""
    T, k = index.shape
    n, slots = T * k, min(num_experts, T * k)
    pairs, xf = buffers or decode_buffers(T, k, num_experts, wpad, index.device)
    idx, w = index.to(torch.int64).contiguous(), weights.float().contiguous()
    xh = x.half().contiguous()
    blocks = 1 + min(64, -(-max(xf.numel(), out.numel()) // 1024))  # block 0 groups
    px = pieces or _NO_X_PIECES
    p, i = launch.ptr, np.int32
    launch.launch(
        "decode_prep",
        (blocks + px.blocks,),
        (geometry.PREP_THREADS,),
        (p(idx), p(w), i(n), i(k), i(num_experts), i(slots))
        + (p(pairs.token), p(pairs.weight), p(pairs.expert), p(pairs.lo), p(pairs.hi))
        + (p(xh), i(T), i(x.shape[1]), i(wpad), p(xf), p(out), i(out.numel()))
        + px.args,
        shared_mem=geometry.group_smem(num_experts),
    )
    return pairs, xf


class WidthSpan(NamedTuple):
    """A layer's blocks at the widths the kernels read: what the launcher's rule looks at."""

    narrowest: int
    widest: int
    wide: float  # the share of the layer's weights in blocks wider than geometry.POPC_MAX_BITS
    wider: float  # the share in blocks wider than 5 bits (past p1b5's binary mma)
    gate_up_wide: float  # the same two shares of its gate and up weights alone: where the
    gate_up_wider: float  # one-token builds p1 and n1p1 differ on a large layer (the same down)


@dataclass
class Routing:
    """What `prepare_routed` writes besides the pairs: each token's top-k and the shared expert's
    gate, and the router logits they came from (fp16 values held as fp32)."""

    index: torch.Tensor  # int64 [T, k]
    weights: torch.Tensor  # float32 [T, k]
    scale: torch.Tensor | None  # float32 [T]: sigmoid of the shared expert's gate (None: none)
    logits: torch.Tensor  # float32 [T, experts (+ 1: the shared gate's)]


def routing_buffers(T: int, spec: MoESpec, shared_gate: bool, device: torch.device) -> Routing:
    rows = spec.num_experts + shared_gate
    return Routing(
        index=torch.empty(T, spec.top_k, dtype=torch.int64, device=device),
        weights=torch.empty(T, spec.top_k, dtype=torch.float32, device=device),
        scale=torch.empty(T, dtype=torch.float32, device=device) if shared_gate else None,
        logits=torch.empty(T, rows, dtype=torch.float32, device=device),
    )


ROUTE_MAX_K = 8  # top-k route_prep takes (cuda/route.cu)
ROUTE_ORDERS = {"softmax_topk": 0, "topk_softmax": 1}


def route_slices(H: int) -> int:
    """Warps of one router dot product over H (cuda/route.cu router_logits): the fewest, a power
    of two up to a block's warps, that leave each lane at most ROUTE_LOADS loads a row."""
    slices, warps = 1, geometry.PREP_THREADS // 32
    while slices < warps and -(-H // (8 * slices)) > 32 * ROUTE_LOADS:
        slices *= 2
    return slices


def can_route(spec: MoESpec, x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """Whether `FusedMoE.routed` takes this call: always on the CPU (torch's router); on CUDA
    when `prepare_routed` does, a decode of fp16 tokens and router, rows a multiple of 8 values
    starting 16-byte aligned (the dot products load 16 bytes at a time), at most 256 experts and
    top-8."""
    if not x.is_cuda:
        return True
    return (
        x.shape[0] <= geometry.DECODE_MAX_TOKENS
        and x.dtype == gate_weight.dtype == torch.float16
        and x.shape[1] % 8 == 0
        and x.data_ptr() % 16 == 0
        and gate_weight.data_ptr() % 16 == 0
        and spec.num_experts <= ROUTE_MAX_EXPERTS
        and spec.top_k <= ROUTE_MAX_K
        and spec.order in ROUTE_ORDERS
    )


def prepare_routed(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_gate_weight: torch.Tensor | None,
    spec: MoESpec,
    wpad: int,
    out: torch.Tensor,
    done: torch.Tensor,
    buffers: tuple[Pairs, torch.Tensor] | None = None,
    routing: Routing | None = None,
    pieces: XPieces | None = None,
) -> tuple[Pairs, torch.Tensor, Routing]:
    """`prepare_decode` with the router folded into its launch: logits (x @ gate_weight.T, fp16
    values), each token's top-k in the recipe's order, the shared expert's gate, then the pairs,
    x in fragment order, `out` zeroed and x's `pieces`. x, gate weights: fp16 (`can_route`).
    `done`: an int32 counter, zero between launches (the kernel's last block resets it)."""
    T, H = x.shape
    shared = shared_gate_weight is not None
    pairs, xf = buffers or decode_buffers(T, spec.top_k, spec.num_experts, wpad, x.device)
    routing = routing or routing_buffers(T, spec, shared, x.device)
    prepared = route_launch(T, H, spec, shared, wpad, done, pairs, xf, routing, pieces)
    prepared(*routed_pointers(x, gate_weight, shared_gate_weight, out))
    return pairs, xf, routing


def routed_pointers(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_gate_weight: torch.Tensor | None,
    out: torch.Tensor,
) -> tuple[int, int, int, int]:
    """What a `route_launch` takes at each call: x, the router's and the shared gate's weights
    (0: none), out."""
    sgw = 0 if shared_gate_weight is None else shared_gate_weight.contiguous().data_ptr()
    return x.contiguous().data_ptr(), gate_weight.contiguous().data_ptr(), sgw, out.data_ptr()


def route_launch(
    T: int,
    H: int,
    spec: MoESpec,
    shared: bool,
    wpad: int,
    done: torch.Tensor,
    pairs: Pairs,
    xf: torch.Tensor,
    routing: Routing,
    pieces: XPieces | None,
) -> launch.Prepared:
    """`prepare_routed`'s launch for T tokens of H into these buffers: `routed_pointers` fill
    its holes (x, router weights, shared gate weights, out [T, H] float32) at each call."""
    E, k = spec.num_experts, spec.top_k
    slots, units, slices = min(E, T * k), max(xf.numel(), T * H), route_slices(H)
    warps = T * (E + shared) * slices
    blocks = min(
        2 * geometry.sm_count(), max(-(-warps // (geometry.PREP_THREADS // 32)), -(-units // 1024))
    )
    px = pieces or _NO_X_PIECES
    p, i, hole = launch.ptr, np.int32, np.uint64(0)
    head = (
        (hole, i(T), i(H), hole, i(E), hole, i(k))  # x, its shape, router and shared gate
        + (i(ROUTE_ORDERS[spec.order]), i(spec.norm_topk_prob), np.float32(spec.routed_scaling))
        + (p(routing.logits), p(done), p(routing.index), p(routing.weights))
        + (np.uint64(routing.scale.data_ptr() if shared else 0), i(slots))
        + (p(pairs.token), p(pairs.weight), p(pairs.expert), p(pairs.lo), p(pairs.hi))
        + (i(wpad), p(xf))
    )
    args = head + (hole, i(T * H)) + px.args + (i(slices),)  # out
    holes = (0, 3, 5, len(head))
    grid, smem = (blocks + px.blocks,), geometry.group_smem(E)
    return launch.Prepared("route_prep", grid, (geometry.PREP_THREADS,), args, holes, smem)


@functools.lru_cache(maxsize=256)  # bounded: prefill meets every prompt length
def _all_tokens(T: int, expert: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    i32 = torch.int32
    return (
        torch.arange(T, dtype=i32, device=device),
        torch.ones(T, device=device),
        torch.full((1,), expert, dtype=i32, device=device),
        torch.zeros(1, dtype=i32, device=device),
        torch.full((1,), T, dtype=i32, device=device),
    )


def all_tokens(T: int, scale: torch.Tensor | None, expert: int, device: torch.device) -> Pairs:
    """One slot holding every token (the shared expert), weighted by its gate. Its constant
    tensors are made once per (T, expert, device): no launch and no host copy per call (graphs)."""
    # under stream capture the fills are only recorded, not run: nothing to cache then
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    make = _all_tokens.__wrapped__ if capturing else _all_tokens
    token, ones, experts, lo, hi = make(T, expert, device)
    weight = ones if scale is None else scale.reshape(-1).float()
    return Pairs(token=token, weight=weight, expert=experts, lo=lo, hi=hi)


@functools.lru_cache(maxsize=256)  # bounded: prefill meets every prompt length
def _one_slot_tiles(T: int, device: torch.device) -> torch.Tensor:
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


def token_tiles(x: torch.Tensor, wpad: int, pairs: Pairs, info: torch.Tensor) -> torch.Tensor:
    """`wgmma_tiles(x, wpad, pairs.token[tile_plan(pairs).pair])` in one launch (CUDA), flat
    [tiles, 128 * 32 * wpad], for the tiles `info` plans (`tile_plan(pairs).info`). Tiles past
    the last real one (slot -1) are left unwritten: no kernel reads them."""
    xh = x.half().contiguous()
    tiles = info.shape[0]
    xt = torch.empty(tiles, TILE_TOKENS * 32 * wpad, dtype=torch.float16, device=x.device)
    units = wpad // 4 * 2048  # 16-byte units a tile (cuda/prefill_wg.cu token_tiles)
    p, i = launch.ptr, np.int32
    launch.launch(
        "token_tiles",
        (min(64, -(-units // 256)), tiles),
        (256,),
        (p(xh), i(x.shape[1]), i(wpad), p(pairs.token), p(pairs.lo), p(pairs.hi), p(info), p(xt)),
    )
    return xt


# The popc kernels save ~15% of a one-token slot's streaming and cost more a call (x's pieces in
# the prep launch, popc_planes for h). On the H200 one-token calls win on Mixtral and Qwen1.5-MoE
# (once popc_planes let down launch early: routed, Qwen1.5-MoE 42.5 -> 38.9 us at 3 bits), not
# on the smaller layers (P1_MIN_WEIGHTS below); calls of 2..POPC_MAX_TOKENS tokens win on
# Mixtral (~352M expert weights a token; 1.14-1.23x)
# and lose on Qwen1.5-MoE (69M) and Qwen3-MoE (38M; 2 tokens, routed: 44.3 against 52.2 us at 3
# bits). So one token takes them from P1_MIN_WEIGHTS a token, a few tokens from POPC_MIN_WEIGHTS
# (docs/decisions/022-popc-by-layer-size.md), while their blocks are narrow enough
# (`FusedMoE._popc_kind`).
POPC_MIN_WEIGHTS = 128 << 20
# FusedMoE.popc_decode's default (None: by the rule above; tools/kernel-dev/perf_kernel_ab.py's
# `popc=`)
POPC_DECODE: bool | None = None
# One-token calls on a large layer (`_popc_pays`) may take the 5-bit build (`p1b5`: 5-bit blocks
# on the binary mma too, not the lookup) where its rule says (below); off, they do not
# (tools/kernel-dev/perf_kernel_ab.py's `b5=0`).
POPC_B5 = True
# One token takes the popc kernels on a layer reading at least P1_MIN_WEIGHTS a token, and the
# lookup kernels below it: on Qwen3-MoE (37.7M) and an OLMoE layer (50.3M: 64 experts, top 8,
# 1024 x 2048) the lookup kernels were up to 12% faster than `p1` at 2-4 bits (both shapes at 2
# bits 11-12%, OLMoE at 4 bits 5%) and at most 1.6% slower, and 2-15% faster with wide blocks
# (H200, docs/decisions/022-popc-by-layer-size.md); on Qwen1.5-MoE (69.2M with its shared
# expert) and Mixtral
# `p1` leads by 7-35% at 2-4 bits.
# With blocks past 4 bits (`FusedMoE._wide_kind`; every build timed on the same draws, `p1` on
# one CTA a gate_up tile, GATE_UP_RUNS; docs/decisions/034-wide-block-rule.md):
# - A large layer (POPC_MIN_WEIGHTS, Mixtral) takes `p1b5` from P1B5_FROM_WIDE of its weights
#   past 4 bits while under P1B5_UNTIL_WIDER are past 5 (every wide block at 5 bits: p1 led to
#   0.42, p1b5 from 0.5, 173.6 against 177.0 us; half the blocks at 5 and one or two of 24 at 6
#   or 8: p1b5 3-11% ahead; four at 6: p1 172.1, p1b5 182.7). Else the split build (n1p1, `_kind`:
#   the lookup gate_up, the popc down) from P1_UNTIL_GATE_UP_WIDE of its gate and up weights past
#   4 bits or P1_UNTIL_GATE_UP_WIDER past 5, else `p1`. Only gate and up count: both builds run
#   the same down, and `p1` reads a wide gate or up (and the narrow one beside it) by a lookup on
#   4 CTAs an SM where `gate_up_n1` runs more (every gate at 5 bits: the split 141.7 against
#   147.5 us; every down at 6 bits: `p1` 149.5, the split 176.9).
# - A layer between them (Qwen1.5-MoE) takes `p1` while under MID_P1_UNTIL_WIDE of its weights
#   are past 4 bits (5-8 bits on 2-8% of the blocks: 1-10% faster than the split), else the split
#   build (1-11% faster than the lookup kernels in 15 of 19 cells, within 1.2% of them in the
#   rest); p1b5 was 12-45% slower than the others in every cell. Its downs count too: past 4
#   bits they cost `p1` more than the split (every down at 8 bits: 68.6 against 63.9 us).
# A call of 2..POPC_MAX_TOKENS tokens takes the popc kernels below PN_UNTIL_WIDE past 4 bits and
# the lookup ones from it on (their slots on wide blocks run a lookup slower than the lookup
# kernels': 8 tokens, three quarters of the blocks at 8 bits, 1032 against 977).
P1_MIN_WEIGHTS = 56 << 20
P1B5_FROM_WIDE = 0.45
P1B5_UNTIL_WIDER = 0.12
P1_UNTIL_GATE_UP_WIDE = 0.5
P1_UNTIL_GATE_UP_WIDER = 0.3
MID_P1_UNTIL_WIDE = 0.1
PN_UNTIL_WIDE = 0.5

_NO_PIECES = (np.uint64(0),)  # the null x-pieces pointer the lookup kernels are passed
# gate_up's per-tile grid: no shares (runs, scratch rows, tickets)
_NO_RUNS = (np.int32(0), np.uint64(0), np.uint64(0))
# the one-token popc builds (their gate_up on a persistent grid) and the widest block each one's
# binary mma reads
_ONE_TOKEN_BITS = {"p1": 4, "p1b3": 3, "p1b5": 5}
# One token on a layer of P1_MIN_WEIGHTS the rule sends off the popc builds (blocks past 4
# bits): gate_up on the lookup, down on the popc build after popc_planes ("n1p1", `_builds`),
# whose down reads its narrow blocks on the binary mma and its wide ones on a lookup of its own,
# faster than down_n1's (Mixtral: 1.6-8% off the lookup kernels in 7 of 10 cells, 1-3% slower
# on two budget mixes), also where no block is narrow enough for its mma (every block at 5-8
# bits or the planner's mixes past budget 0.55: Qwen1.5-MoE 9-11% faster, Mixtral 0-5%;
# docs/decisions/034-wide-block-rule.md); off, down on the lookup too. A decode kind names one
# build for both launches but this one.
POPC_DOWN = True
_SPLIT_BUILDS = {"n1p1": ("n1", "p1")}


def _builds(kind: str) -> tuple[str, str]:
    """(gate_up's build, down's build) of a decode kind."""
    return _SPLIT_BUILDS.get(kind, (kind, kind))


def _popc(build: str) -> bool:
    """Whether a build is one of the popc kernels' (x's or h's pieces on the binary mma)."""
    return build.startswith("p")


# FusedMoE.gate_up_runs' default: None, one-token gate_up grids run persistent by
# geometry.gate_up_runs, but one CTA a tile where a block is wider than the build's binary mma
# (`_past_mma`: on Mixtral one CTA a tile was 3-13% faster than the wave in 16 of 16 cells of
# 5-8-bit blocks, with the wave's shares weighed by each tile's cost, since removed; at 4 bits
# the wave is 4% faster; docs/decisions/034-wide-block-rule.md); a count, that many CTAs in
# equal shares
# (0: one a tile; tools/kernel-dev/perf_kernel_ab.py sets it for A/B runs)
GATE_UP_RUNS: int | None = None
# FusedMoE.down_split's default: None, down's k-split by geometry.k_split; a count, that one
DOWN_SPLIT: int | None = None
# The sm_90a prefill's down on a wave of CTAs that split the last units' columns (cuda/prefill_wg.cu
# down_span) where its rows are at least this many chunks of 8 plane words long: Mixtral (56)
# gained 2-6% at 512 tokens; Qwen1.5-MoE's shared expert (22) gained nothing measurable, and
# short rows lose (docs/decisions/017-prefill-down-stream-k.md).
DOWN_STREAM_K_CHUNKS = 32
# FusedMoE.down_stream_k's default: None, by the rule above; True / False (perf_kernel_ab's @sk=)
DOWN_STREAM_K: bool | None = None
# geometry.down_groups' one-wave plan for the popc kernels' down beside a shared expert (False:
# the routed split and the shared expert's balanced one as they come; perf_kernel_ab's @dwave=0)
DOWN_ONE_WAVE = True


@dataclass(frozen=True)
class DecodeLaunch:
    """The shape side of a decode call's two launches: grids, and the scalar arguments around
    the pointers (cuda/lookup.cu *_ENTRY: the routed group's after x / h, the shared expert's after
    its own pointers). Made once per (layer, routed slots, shared expert): an eager decode is
    host-bound."""

    gate_up_grid: tuple[int, int]
    runs: int  # gate_up's persistent routed CTAs (cuda/lookup.cu Run; the shared expert's after)
    routed_tiles: int  # gate_up's routed tiles (16 rows of gate and up each), all slots'
    gate_up_routed: tuple
    gate_up_shared: tuple
    down_grid: tuple[int, int, int]
    down_routed: tuple
    down_shared: tuple


class FusedMoE:
    def __init__(self, spec: MoESpec, dt: DeviceTable, index: dict[tuple[int, int, str], int]):
        """`index`: (layer, expert, proj) -> block (shared experts: expert = num_experts)."""
        if spec.act != "silu":
            raise ValueError(f"activation {spec.act}: the kernels implement silu")
        self.spec, self.dt = spec, dt
        experts = spec.num_experts + (1 if spec.has_shared else 0)
        self.block_ids: dict[int, torch.Tensor] = {}
        self._layer_blocks: dict[int, np.ndarray] = {}  # host copy: the widths' page-table rows
        self._block_weights = np.array([b.rows * b.cols for b in dt.blocks], dtype=np.float64)
        self.proj: dict[tuple[int, bool, str], Proj] = {}
        for layer in sorted({key[0] for key in index}):
            ids = [[index[(layer, e, p)] for p in ("gate", "up", "down")] for e in range(experts)]
            self.block_ids[layer] = torch.tensor(ids, dtype=torch.int32, device=dt.device)
            self._layer_blocks[layer] = np.array(ids, dtype=np.int64).ravel()
            for e, shared in ((0, False), (spec.num_experts, True)):
                if (layer, e, "gate") not in index:
                    continue
                for p in ("gate", "up", "down"):
                    b = dt.blocks[index[(layer, e, p)]]
                    self.proj[(layer, shared, p)] = Proj(b.rows, b.cols, b.words, b.rows_per_table)
        self._hp: dict[tuple[int, int], torch.Tensor] = {}
        self._decode_buffers: dict[tuple[int, int, int], tuple[Pairs, torch.Tensor]] = {}
        self._routing: dict[tuple[int, bool], Routing] = {}
        on_cuda = dt.device.type == "cuda"  # route_prep's counter, zero between launches
        self._done = torch.zeros(1, dtype=torch.int32, device=dt.device) if on_cuda else None
        if on_cuda:  # every kernel compiled (or found in CuPy's cache) now, while the model loads,
            build.modules()  # not in a first request's step (104 s on a fresh H200 machine)
        self._launches: dict[tuple[int, int, bool, str, bool], DecodeLaunch] = {}
        self._run_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.gate_up_runs = GATE_UP_RUNS  # one-token gate_up's persistent CTAs (None: auto)
        self.down_split = DOWN_SPLIT  # CTAs sharing a down tile's columns (None: auto)
        self.down_stream_k = DOWN_STREAM_K  # prefill down on a stream-K wave (None: auto)
        # `routed`'s launches by (layer, T, shared gate, kernels, `_past_mma`): made once, their
        # buffers reused
        self._routed_plans: dict[tuple, tuple] = {}
        self._piece_buffers: dict[tuple, torch.Tensor] = {}
        self._x_pieces_made: dict[tuple[int, int], XPieces] = {}  # by (gate rows' words, T)
        # layer -> (width_version, WidthSpan): `_widths`
        # `decode_builds` by T, for the width upload `_builds_version` (cleared at the next)
        self._builds: dict[int, tuple] = {}
        self._builds_version = -1
        self._width_spans: dict[int, tuple[int, WidthSpan]] = {}
        reads = {layer: self._weights_a_token(layer) for layer in self.block_ids}
        self._popc_pays = {layer: n >= POPC_MIN_WEIGHTS for layer, n in reads.items()}
        self._p1_pays = {layer: n >= P1_MIN_WEIGHTS for layer, n in reads.items()}
        # prefill kernels: "wgmma" (sm_90a, warpgroup mma) or "mma" (mma.sync, any sm_80+)
        self.prefill_kernel = "wgmma" if dt.device.type == "cuda" and build.has_wgmma() else "mma"
        # decode calls of up to POPC_MAX_TOKENS tokens on the popc kernels (cuda/popc.cu
        # gate_up_p1 / _pn: one-token slots on binary tensor cores), where a block is narrow
        # enough: True, False (the lookup kernels only), or None (default): one-token calls on
        # the layers that read at least P1_MIN_WEIGHTS a token (`_p1_pays`), calls of a few
        # tokens from POPC_MIN_WEIGHTS (`_popc_pays`), blocks past 4 bits by `_popc_kind`'s rule
        # and `_kind`'s n1p1
        self.popc_decode: bool | None = POPC_DECODE
        # a decode kind every call takes (A/B sweeps over builds, e.g. "n1p1"; it must suit the
        # call's token count and popc_decode), or None: `_kind`'s rule
        self.decode_kind: str | None = None

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        index: torch.Tensor,
        shared_scale: torch.Tensor | None = None,
        reference: bool = False,
        path: str | None = None,
    ) -> torch.Tensor:
        """Sum over routed experts (and the shared one) for tokens x [T, H]: float32 [T, H].
        `path` forces "decode" or "prefill" on CUDA (benchmarks); default: by token count."""
        T, E = x.shape[0], self.spec.num_experts
        if reference or not x.is_cuda:
            path = "torch"
        elif path is None:
            path = "decode" if T <= geometry.DECODE_MAX_TOKENS else "prefill"
        if path == "decode":  # one launch groups, zeroes out and lays x out for both kernels
            out = torch.empty(T, x.shape[1], dtype=torch.float32, device=x.device)
            wpad = self.proj[(layer, False, "gate")].wpad
            buffers = self._buffers(T, index.shape[1], wpad, x.device)
            px = self._x_pieces(layer, T, x.device)
            pairs, xf = prepare_decode(x, index, weights, E, wpad, out, buffers, px)
            shared = all_tokens(T, shared_scale, E, x.device) if self.spec.has_shared else None
            self._decode(layer, xf, pairs, out, shared, px)
            return out
        if path == "torch":
            out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
            self._torch(layer, False, x, group(index, weights, E), out)
            if self.spec.has_shared:
                self._torch(layer, True, x, all_tokens(T, shared_scale, E, x.device), out)
            return out
        out = torch.empty(T, x.shape[1], dtype=torch.float32, device=x.device)
        pairs, tiles = prepare_prefill(index, weights, E, out)
        self._prefill(layer, False, x, pairs, tiles, out)
        if self.spec.has_shared:
            shared = all_tokens(T, shared_scale, E, x.device)
            self._prefill(layer, True, x, shared, _one_slot_tiles(T, x.device), out)
        return out

    def routed(
        self,
        layer: int,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        shared_gate_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Routing]:
        """Router and experts of a call `can_route` accepts: float32 [T, H], and the routing
        chosen. On CUDA one launch routes, groups and lays x out (`prepare_routed`), then the
        decode kernels run; the routing is in buffers the next call of the same token count
        overwrites. On the CPU: torch's router (`route`), then the torch path."""
        if not x.is_cuda:  # the reference: torch's router, then the torch path
            return self._routed_torch(layer, x, gate_weight, shared_gate_weight)
        T = x.shape[0]
        out = torch.empty(T, x.shape[1], dtype=torch.float32, device=x.device)
        px = self._x_pieces(layer, T, x.device)
        kind = self._kind(layer, T, px)
        key = (layer, T, shared_gate_weight is not None, kind, self._past_mma(layer, kind))
        plan = self._routed_plans.get(key)
        if plan is None:
            plan = self._routed_plan(layer, T, x.shape[1], key[2], px)
            if not torch.cuda.is_current_stream_capturing():  # see all_tokens: made, not filled
                self._routed_plans[key] = plan
        route, gate_up, down, routing = plan
        route(*routed_pointers(x, gate_weight, shared_gate_weight, out))
        gate_up()
        down(out.data_ptr())
        return out, routing

    def _routed_plan(
        self, layer: int, T: int, H: int, shared: bool, px: XPieces | None
    ) -> tuple[launch.Prepared, Callable[[], None], launch.Prepared, Routing]:
        """The three launches of a `routed` call of T tokens (route_prep, gate_up, down) into
        this object's buffers for such calls, and the routing buffers they fill."""
        wpad = self.proj[(layer, False, "gate")].wpad
        if (T, shared) not in self._routing:
            self._routing[(T, shared)] = routing_buffers(T, self.spec, shared, self.dt.device)
        routing = self._routing[(T, shared)]
        pairs, xf = self._buffers(T, self.spec.top_k, wpad, self.dt.device)
        route = route_launch(T, H, self.spec, shared, wpad, self._done, pairs, xf, routing, px)
        E = self.spec.num_experts
        one = all_tokens(T, routing.scale, E, self.dt.device) if self.spec.has_shared else None
        launches = self._decode_launches(layer, xf, pairs, one, px)
        return (route, *launches, routing)

    def _routed_torch(
        self,
        layer: int,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        shared_gate_weight: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Routing]:
        logits = F.linear(x, gate_weight)
        weights, index = route(logits, self.spec)
        scale = None
        if shared_gate_weight is not None:
            scale = torch.sigmoid(F.linear(x, shared_gate_weight)).reshape(-1).float()
        out = self(layer, x, weights, index, scale)
        return out, Routing(index, weights, scale, logits.float())

    def _buffers(
        self, T: int, k: int, wpad: int, device: torch.device
    ) -> tuple[Pairs, torch.Tensor]:
        """A decode call's pairs and fragment-order x, made once per (T, k, wpad) and reused: an
        eager decode is host-bound, and a torch.empty costs ~5 us of it. The kernels that read
        them run in stream order, so the next call cannot overwrite them early."""
        if (T, k, wpad) not in self._decode_buffers:
            E = self.spec.num_experts
            self._decode_buffers[(T, k, wpad)] = decode_buffers(T, k, E, wpad, device)
        return self._decode_buffers[(T, k, wpad)]

    # --- the torch path: CPU execution and the kernels' reference ------------------------------

    def _torch(self, layer: int, shared: bool, x: torch.Tensor, pairs: Pairs, out: torch.Tensor):
        ids = self.block_ids[layer]
        xf = x.float()
        for s in range(pairs.expert.numel()):
            lo, hi = int(pairs.lo[s]), int(pairs.hi[s])
            if hi <= lo:
                continue
            g, u, d = (self.dt.weight(int(b)) for b in ids[int(pairs.expert[s])].tolist())
            tok = pairs.token[lo:hi].long()
            h = F.silu(xf[tok] @ g.T) * (xf[tok] @ u.T)
            out.index_add_(0, tok, (h @ d.T) * pairs.weight[lo:hi, None])

    # --- CUDA: two kernels per expert group ---------------------------------------------------

    def _scalars(self, layer: int, shared: bool) -> tuple[tuple, tuple]:
        """The shape arguments both kernel pairs take after their two pointers (cuda/lookup.cu):
        gate_up (rows, words, wpad, h's wpad, bits bytes, rows per table), down (the same of
        down, without h's)."""
        gu, dn = self.proj[(layer, shared, "gate")], self.proj[(layer, shared, "down")]
        i32, i64 = np.int32, np.int64
        gate_up = (i32(gu.rows), i32(gu.words), i32(gu.wpad), i32(dn.wpad), i64(gu.bits_nbytes))
        down = (i32(dn.rows), i32(dn.words), i32(dn.wpad), i64(dn.bits_nbytes))
        return gate_up + (i32(gu.rows_per_table),), down + (i32(dn.rows_per_table),)

    def _h(self, layer: int, shared: bool, pairs: Pairs, device: torch.device) -> torch.Tensor:
        """h's buffer (fp16 [pairs, h's wpad, 32]) of a group: reused across calls (fixed
        pointers for CUDA graphs); the routed and shared groups never share one (one launch
        writes both)."""
        key = (shared, pairs.token.numel(), self.proj[(layer, shared, "down")].wpad)
        if key not in self._hp:
            self._hp[key] = torch.empty(*key[1:], 32, dtype=torch.float16, device=device)
        return self._hp[key]

    def _decode(
        self,
        layer: int,
        xf: torch.Tensor,
        pairs: Pairs,
        out: torch.Tensor,
        shared: Pairs | None,
        px: XPieces | None = None,
    ):
        """<= 64 tokens, x already in fragment order (`prepare_decode`): one token pass, no host
        sync (graph-capturable). Each kernel covers the routed slots and, when there is one, the
        shared expert's slot in one launch (lookup.cu *_ENTRY): the shared expert streams beside
        the routed ones, its CTAs numbered through grid rows after the routed slots'. With x's
        pieces (`_x_pieces`, built by the prep launch) the popc kernels run instead."""
        gate_up, down = self._decode_launches(layer, xf, pairs, shared, px)
        gate_up()
        down(out.data_ptr())

    def forget_launches(self) -> None:
        """Drop the launches kept for decode and `routed` calls. Their grids and arguments
        follow gate_up_runs and down_split as they were when each was made: call this after
        changing one (A/B runs)."""
        self._launches.clear()
        self._routed_plans.clear()

    def _decode_launches(
        self,
        layer: int,
        xf: torch.Tensor,
        pairs: Pairs,
        shared: Pairs | None,
        px: XPieces | None,
    ) -> tuple[Callable[[], None], launch.Prepared]:
        """`_decode`'s launches into these buffers: gate_up (with popc_planes after it when
        down is a popc build) and down, whose one hole is `out`. Both take PDL: gate_up behind
        decode_prep or route_prep (which lets it in once its routing block is the last one left),
        down behind gate_up."""
        kind = self._kind(layer, xf.shape[0], px)
        key = (layer, pairs.expert.numel(), shared is not None, kind, self._past_mma(layer, kind))
        if key not in self._launches:
            self._launches[key] = self._decode_launch(*key[:4])
        plan, ptr = self._launches[key], launch.ptr
        gu_build, dn_build = _builds(kind)
        groups = [(False, pairs)] + ([(True, shared)] if shared is not None else [])
        hp = [self._h(layer, t, p, xf.device) for t, p in groups]
        # the second group's pointers: the routed group again when there is no shared expert
        second = groups[-1][1].slot_args() + (ptr(hp[-1]),)
        common = self.dt.kernel_args() + pairs.kernel_args(self.block_ids[layer])
        # the lookup kernels take no pieces; the popc gate_up x's (built by the prep launch)
        xpx = (ptr(px.buf),) if _popc(gu_build) else _NO_PIECES
        hpx, planes = _NO_PIECES * 2, None
        if _popc(dn_build):  # each pair's h's 16-bit planes, once a call (cuda/popc.cu popc_planes)
            dn = [self.proj[(layer, t, "down")] for t, _ in groups]
            hps = [
                self._pieces(t, h.shape[0], d.words, xf.device)
                for (t, _), h, d in zip(groups, hp, dn, strict=True)
            ]
            hpx = (ptr(hps[0]), ptr(hps[-1]))
            planes = self._planes(list(zip(hp, dn, hps, strict=True)))
        gu_args = (ptr(xf), ptr(hp[0])) + plan.gate_up_routed + second + plan.gate_up_shared
        block = (32 * geometry.WARPS,)
        gate_up = launch.Prepared(
            f"gate_up_{gu_build}", plan.gate_up_grid, block,
            common + gu_args + xpx + self._run_args(plan, xf.device),
            early=True,
        )  # fmt: skip
        dn_args = (ptr(hp[0]), np.uint64(0)) + plan.down_routed + second + plan.down_shared  # out
        # down stages while gate_up finishes and waits before it reads h
        down = launch.Prepared(
            f"down_{dn_build}", plan.down_grid, block, common + dn_args + hpx, (len(common) + 1,),
            early=True,
        )  # fmt: skip
        if planes is None:
            return gate_up, down

        def gate_up_then_planes() -> None:
            gate_up()
            planes()

        return gate_up_then_planes, down

    def _run_args(self, plan: DecodeLaunch, device: torch.device) -> tuple:
        """gate_up's last arguments: its persistent routed CTAs (of the grid's, the shared
        expert's after them) and, for the tiles split between two shares, their halves' rows
        (2 halves x gate and up x ROWS floats) and tickets (zero between launches: a tile's
        second half to finish resets the tile's): a scratch a CTA and one more a group
        (cuda/lookup.cu RUN)."""
        runs, ctas = plan.runs, plan.gate_up_grid[0]
        if runs == 0:
            return _NO_RUNS
        n = ctas + 1 + (ctas > runs)
        if n not in self._run_buffers:
            rows = torch.empty(n * 4 * geometry.ROWS, dtype=torch.float32, device=device)
            self._run_buffers[n] = rows, torch.zeros(n, dtype=torch.int32, device=device)
        rows, tickets = self._run_buffers[n]
        return (np.int32(runs), launch.ptr(rows), launch.ptr(tickets))

    def decode_builds(self, T: int) -> tuple[tuple[str, bool], ...]:
        """The decode kernels a call of T tokens launches in each layer now (`_kind`,
        `_past_mma`): what a CUDA graph of a decode step fixes when it is captured
        (runtime/decode_graphs.py). Any build reads any width, so a graph captured for other
        builds stays right, only slower. Kept until the next width upload."""
        if self._builds_version != self.dt.width_version:  # a step's S bucket may alternate
            self._builds.clear()
            self._builds_version = self.dt.width_version
        if T not in self._builds:
            dev, out = self.dt.device, []
            for layer in self.block_ids:
                kind = self._kind(layer, T, self._x_pieces(layer, T, dev))
                out.append((kind, self._past_mma(layer, kind)))
            self._builds[T] = tuple(out)
        return self._builds[T]

    def _past_mma(self, layer: int, kind: str) -> bool:
        """Whether some block of `layer` is wider than the binary mma of a one-token gate_up
        of `kind` reads (those tiles take its lookup). It sets that gate_up's grid
        (`_gate_up_runs`), so the launches are kept by it too: widths the pager widens reach
        them."""
        gate_up = _builds(kind)[0]
        return gate_up in _ONE_TOKEN_BITS and self._widths(layer).widest > _ONE_TOKEN_BITS[gate_up]

    def _kind(self, layer: int, T: int, px: XPieces | None) -> str:
        """The decode kernels of a call of T tokens: the popc kernels' build when x's pieces
        are given (`_x_pieces`), else the lookup kernels of T's n-tiles, but for one token on a
        layer of at least P1_MIN_WEIGHTS (`POPC_DOWN`): the lookup gate_up with the popc down
        ("n1p1"), even where no block is narrow enough for that down's binary mma (its lookup
        of wide blocks beats down_n1's; docs/decisions/034-wide-block-rule.md)."""
        if self.decode_kind is not None:
            return self.decode_kind
        popc_kind = self._popc_kind(layer, T) if px is not None else None
        if popc_kind:
            return popc_kind
        if T == 1 and POPC_DOWN and self.popc_decode is None and self._p1_pays[layer]:
            return "n1p1"
        return f"n{geometry.n_tiles(T)}"

    def _popc_kind(self, layer: int, T: int) -> str | None:
        """The popc kernels' build for a call of T tokens in `layer`, or None for the lookup
        kernels. Up to POPC_MAX_TOKENS tokens when popc_decode is set or (None) on a layer large
        enough: one token from P1_MIN_WEIGHTS (`_p1_pays`), a few from POPC_MIN_WEIGHTS
        (`_popc_pays`). "p1" for one token, "pn" for more (their slots
        of several tokens take the lookup inside the launch; kept apart so that the one-token
        build carries none of it), "b3" (binary mma up to 3 bits; 6 CTAs an SM for one token,
        5 for several, against 4) when no block is wider than 3 bits in the widths the kernels
        read (the last `DeviceTable.sync`), None when none is as narrow as the build's mma reads.
        With blocks wider than 4 bits, by default (popc_decode None): one token by
        `_wide_kind`; a few tokens take the lookup kernels from PN_UNTIL_WIDE of the weights on.
        popc_decode True: p1b5 (p1 with POPC_B5 off) or pn while any block is
        narrow enough. Every build reads every width (wider blocks take its lookup), so a graph
        captured before the pager widens a block stays correct, only slower."""
        auto = self.popc_decode is None
        on = (self._p1_pays if T == 1 else self._popc_pays)[layer] if auto else self.popc_decode
        if T > geometry.POPC_MAX_TOKENS or not on:
            return None
        span = self._widths(layer)
        b3 = "b3" if span.widest <= 3 else ""
        if T > 1:
            if span.narrowest > geometry.POPC_MAX_BITS or (auto and span.wide >= PN_UNTIL_WIDE):
                return None
            return "pn" + b3
        if span.widest <= geometry.POPC_MAX_BITS:
            return "p1" + b3
        if auto:
            return self._wide_kind(layer, span)
        if POPC_B5 and span.narrowest <= 5:
            return "p1b5"
        return "p1" if span.narrowest <= geometry.POPC_MAX_BITS else None

    def _wide_kind(self, layer: int, span: WidthSpan) -> str | None:
        """The default popc build of one token on a layer of P1_MIN_WEIGHTS with a block past 4
        bits (the rule at P1_MIN_WEIGHTS), or None for the split build (`_kind`: the lookup
        gate_up, the popc down). On a large layer (`_popc_pays`): "p1b5" from P1B5_FROM_WIDE of
        its weights past 4 bits while under P1B5_UNTIL_WIDER are past 5; else "p1" while under
        P1_UNTIL_GATE_UP_WIDE of its gate and up weights are past 4 bits and under
        P1_UNTIL_GATE_UP_WIDER past 5. On a smaller one, "p1" while under MID_P1_UNTIL_WIDE of
        its weights are past 4 bits."""
        if not self._popc_pays[layer]:
            return "p1" if span.wide < MID_P1_UNTIL_WIDE else None
        if POPC_B5 and span.wide >= P1B5_FROM_WIDE and span.wider < P1B5_UNTIL_WIDER:
            return "p1b5"  # (a share past 5 bits under 1: a block of at most 5)
        split = (
            span.gate_up_wide >= P1_UNTIL_GATE_UP_WIDE
            or span.gate_up_wider >= P1_UNTIL_GATE_UP_WIDER
        )
        return None if split else "p1"  # (no block at 4 bits or less: every share is 1, split)

    def _widths(self, layer: int) -> WidthSpan:
        """`layer`'s blocks in the widths the kernels read, cached until the next width upload
        (a numpy gather per call is host time on decode)."""
        version, span = self._width_spans.get(layer, (-1, None))
        if version != self.dt.width_version:
            blocks = self._layer_blocks[layer]
            w = self.dt.synced_width[blocks]
            weights = self._block_weights[blocks]
            past = (geometry.POPC_MAX_BITS, _ONE_TOKEN_BITS["p1b5"])

            def shares(w: np.ndarray, weights: np.ndarray) -> list[float]:
                return [float(weights[w > b].sum() / weights.sum()) for b in past]

            gate_up = [a.reshape(-1, 3)[:, :2] for a in (w, weights)]  # (gate, up, down an expert)
            span = WidthSpan(int(w.min()), int(w.max()), *shares(w, weights), *shares(*gate_up))
            version = self.dt.width_version
            self._width_spans[layer] = (version, span)
        return span

    def _weights_a_token(self, layer: int) -> int:
        """Expert weights one token reads in `layer`: top-k routed experts and the shared one."""
        count = {False: self.spec.top_k, True: 1}
        return sum(
            count[g] * p.rows * p.cols for (lay, g, _), p in self.proj.items() if lay == layer
        )

    def _x_pieces(self, layer: int, T: int, device: torch.device) -> XPieces | None:
        """x's pieces when this call takes the popc kernels (`_popc_kind`), else None."""
        if self._popc_kind(layer, T) is None:
            return None
        words = self.proj[(layer, False, "gate")].words
        if (words, T) not in self._x_pieces_made:
            buf = self._pieces("x", T, words, device)
            self._x_pieces_made[(words, T)] = XPieces.over(buf, words, T)
        return self._x_pieces_made[(words, T)]

    def _pieces(
        self, what: str | bool, rows: int, words: int, device: torch.device
    ) -> torch.Tensor:
        """A reused buffer of `rows` rows of x pieces (cuda/pieces.cuh PopcX) for the popc
        kernels: "x" (the tokens), or a group's h (False: routed, True: shared expert)."""
        key = (what, rows, words)
        if key not in self._piece_buffers:
            n = rows * popc.pieces(words) * geometry.PIECE_BYTES
            self._piece_buffers[key] = torch.empty(n, dtype=torch.uint8, device=device)
        return self._piece_buffers[key]

    def _planes(self, jobs: list[tuple[torch.Tensor, Proj, torch.Tensor]]) -> launch.Prepared:
        """popc_planes over one or two groups of fragment-order fp16 rows: (the rows, their
        projection, the pieces they become). A warp a k-step of the longest piece."""
        (s0, p0, d0), (s1, p1, d1) = jobs[0], jobs[-1]
        i32, ptr = np.int32, launch.ptr
        args = (ptr(s0), i32(p0.wpad), i32(p0.words), i32(s0.shape[0]), ptr(d0))
        args += (ptr(s1), i32(p1.wpad), i32(p1.words), ptr(d1))
        grid = (max(popc.pieces(p.words) for _, p, _ in jobs), sum(s.shape[0] for s, _, _ in jobs))
        grid += (geometry.POPC_SPLIT,)
        steps = min(geometry.POPC_STEPS, max(popc.steps(p.words) for _, p, _ in jobs))
        return launch.Prepared("popc_planes", grid, (32 * steps,), args, early=True)

    def _decode_launch(
        self, layer: int, n_routed: int, with_shared: bool, kind: str
    ) -> DecodeLaunch:
        """Grids and shape arguments of a decode call's two launches (cuda/lookup.cu *_ENTRY): fixed
        by the layer, its routed slot count, whether a shared expert rides along and the
        kernels. One-token calls (every slot live) run gate_up on a persistent grid
        (`geometry.gate_up_runs`), its CTAs shared by the routed tiles and the shared expert's
        (`geometry.gate_up_shares`); the popc kernels' down keeps to one wave (`_down_groups`)."""
        i32, i64, rows = np.int32, np.int64, geometry.ROWS
        groups = [False] + ([True] if with_shared else [])
        gu = [self.proj[(layer, g, "gate")] for g in groups]
        dn = [self.proj[(layer, g, "down")] for g in groups]
        assert gu[0].wpad == gu[-1].wpad, "both groups read x at one layout"
        gate_up, down = self._scalars(layer, False)
        # gate_up covers every padded column of h (rows past I are written as zeros)
        tiles = [32 * d.wpad // rows for d in dn]
        gu_build, dn_build = _builds(kind)
        r, t = self._down_groups(dn_build, n_routed, dn)
        t = t or r
        # grid rows after the routed slots' that number the shared expert's CTAs
        extra = (-(-tiles[-1] // tiles[0]), -(-t.slot_ctas // r.slot_ctas))
        extra = extra if with_shared else (0, 0)
        t_tiles = tiles[-1] if with_shared else 0
        past_mma = self._past_mma(layer, gu_build)
        runs, t_runs = self._gate_up_runs(gu_build, tiles[0] * n_routed, t_tiles, past_mma)
        return DecodeLaunch(
            gate_up_grid=(runs + t_runs, 1) if runs else (tiles[0], n_routed + extra[0]),
            runs=runs,
            routed_tiles=tiles[0] * n_routed,
            gate_up_routed=gate_up + (i32(n_routed),),
            gate_up_shared=(i32(gu[-1].rows), i32(dn[-1].wpad), i64(gu[-1].bits_nbytes))
            + (i32(gu[-1].rows_per_table), i32(tiles[-1]), i32(1)),
            down_grid=(r.ctas, n_routed + extra[1], r.split),
            down_routed=down + (i32(r.units), i32(n_routed)),
            down_shared=(i32(dn[-1].words), i32(dn[-1].wpad), i64(dn[-1].bits_nbytes))
            + (i32(dn[-1].rows_per_table), i32(t.units), i32(t.ctas), i32(t.split)),
        )

    def _down_groups(
        self, kind: str, n_routed: int, dn: list[Proj]
    ) -> tuple[geometry.DownGroup, geometry.DownGroup | None]:
        """down's routed group and the shared expert's (`dn[1]`, if any): the routed split
        `down_split`, or by `geometry.k_split`, which fills the GPU for the lookup kernels and
        one wave of the popc kernels' CTAs for them; both groups in one wave where a plan fits
        (`geometry.down_groups`, unless DOWN_ONE_WAVE is off)."""
        if self.down_split is not None and self.down_split < 1:
            raise ValueError(f"down_split {self.down_split}: at least one CTA a tile")
        wave = launch.resident_ctas(f"down_{kind}") if _popc(kind) else None
        shared = (dn[1].rows, dn[1].words) if len(dn) > 1 else None
        return geometry.down_groups(
            (dn[0].rows, dn[0].words), n_routed, shared, wave, self.down_split, DOWN_ONE_WAVE
        )

    def _gate_up_runs(
        self, kind: str, tiles: int, shared_tiles: int, past_mma: bool
    ) -> tuple[int, int]:
        """gate_up's persistent CTAs (cuda/lookup.cu Run) in a one-token call of `tiles` routed
        tiles (every slot live) and the shared expert's `shared_tiles`, (routed, shared):
        `gate_up_runs` of them (at most a CTA a half tile), or `geometry.gate_up_runs` on one
        wave of the kernel's CTAs, split by `geometry.gate_up_shares`; (0, 0), one CTA a tile,
        for the other builds and, unless gate_up_runs is set, where a block is wider than the
        build's mma (`past_mma`: GATE_UP_RUNS)."""
        if kind not in _ONE_TOKEN_BITS:
            return 0, 0
        ctas = self.gate_up_runs
        if ctas is not None and ctas < 0:
            raise ValueError(f"gate_up_runs {ctas}: a count of CTAs, >= 0")
        if ctas is None and past_mma:
            return 0, 0
        if ctas is None:
            wave = launch.resident_ctas(f"gate_up_{kind}")
            ctas = geometry.gate_up_runs(tiles + shared_tiles, wave)
        return geometry.gate_up_shares(ctas, tiles, shared_tiles)

    def _prefill(
        self,
        layer: int,
        shared: bool,
        x: torch.Tensor,
        pairs: Pairs,
        tiles: torch.Tensor,
        out: torch.Tensor,
    ):
        """Any token count: each weight chunk is decoded once and multiplied with up to 128
        tokens of its slot. The sm_90a kernels take the token tiles `tiles` plans (`tile_plan`'s
        info) and sync nothing; the mma.sync ones sync the host once (the largest slot sets the
        passes)."""
        gu, dn = self.proj[(layer, shared, "gate")], self.proj[(layer, shared, "down")]
        common = self.dt.kernel_args() + pairs.kernel_args(self.block_ids[layer])
        gate_up, down = self._scalars(layer, shared)
        i32, ptr = np.int32, launch.ptr
        rows = geometry.PREFILL_ROWS  # per CTA; gate_up covers h's padded columns
        row_tiles = (-(-32 * dn.wpad // rows["gate_up"]), -(-dn.rows // rows["down"]))
        block = (32 * geometry.PREFILL_WARPS,)
        if self.prefill_kernel == "wgmma" and dn.rows % 2 == 0:  # down adds row pairs
            xt = token_tiles(x, gu.wpad, pairs, tiles)
            n_tiles = tiles.shape[0]
            hp = x.new_empty(n_tiles * TILE_TOKENS, 32 * dn.wpad, dtype=torch.float16)
            smem, sk = geometry.PREFILL_WG_SMEM, self._down_stream_k(dn)
            # the stream-K wave's CTAs follow the whole units' (at most every unit the bound plans)
            down_grid = (n_tiles * row_tiles[1] + sk,) if sk else (row_tiles[1], n_tiles)
            grids = [(row_tiles[0], n_tiles), down_grid]
            extras = [(ptr(tiles),), (ptr(tiles), i32(sk), i32(row_tiles[1]), i32(n_tiles))]
            names = ("gate_up_prefill_wg", "down_prefill_wg")
        else:
            most = int((pairs.hi - pairs.lo).max())
            passes = max(1, -(-most // geometry.PREFILL_TOKENS))
            xt = fragment_order(x, gu.wpad)
            hp = torch.empty(pairs.token.numel(), dn.wpad, 32, dtype=torch.float16, device=x.device)
            smem, extras = geometry.PREFILL_SMEM, [(i32(passes),)] * 2
            grids = [(passes * n, pairs.expert.numel()) for n in row_tiles]
            names = ("gate_up_prefill", "down_prefill")
        io = ((ptr(xt), ptr(hp)) + gate_up, (ptr(hp), ptr(out)) + down)
        for name, grid, args, extra in zip(names, grids, io, extras, strict=True):
            launch.launch(name, grid, block, common + args + extra, shared_mem=smem)

    def _down_stream_k(self, dn: Proj) -> int:
        """CTAs of the sm_90a prefill down's stream-K wave (cuda/prefill_wg.cu down_span), or 0 for
        one CTA a (token tile, row tile): `down_stream_k`, or by DOWN_STREAM_K_CHUNKS."""
        on = self.down_stream_k
        if on is None:
            on = -(-dn.words // 8) >= DOWN_STREAM_K_CHUNKS
        return launch.resident_prefill_ctas("down_prefill_wg") if on else 0
