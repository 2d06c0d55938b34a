"""The one launch before a fused MoE call's kernels (CUDA): grouping into pairs, x in fragment
order, `out` zeroed and, for the popc kernels, x's pieces; for decode with the router folded in
(`prepare_routed`: logits, top-k in the recipe's order, the shared expert's gate), for prefill with
the token-tile plan (`prepare_prefill`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pwctl.format.recipe import MoESpec
from pwctl.kernels import geometry, launch, popc, registry
from pwctl.kernels.geometry import ROUTE_LOADS, ROUTE_MAX_EXPERTS
from pwctl.runtime.moe.layouts import tile_bound
from pwctl.runtime.moe.pairs import Pairs, decode_buffers, pair_buffers


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


def variant_of(spec: MoESpec) -> registry.Variant:
    """The kernels' build for `spec`'s experts and router (`registry.variant_for`; a one-line
    ValueError for an activation no kernel computes)."""
    return registry.variant_for(
        spec.act, spec.expert_bias, spec.router_bias, spec.swiglu_alpha, spec.swiglu_limit
    )


def can_route(spec: MoESpec, x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """Whether `FusedMoE.routed` takes this call: always on the CPU (torch's router); on CUDA
    when `prepare_routed` does, a decode of fp16 tokens and router, rows a multiple of 8 values
    starting 16-byte aligned (the dot products load 16 bytes at a time), at most 256 experts and
    top-8 (a router bias, GPT-OSS's, is the build's: `registry.Variant.router_bias`)."""
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
    router_bias: torch.Tensor | None = None,
) -> tuple[Pairs, torch.Tensor, Routing]:
    """`prepare_decode` with the router folded into its launch: logits (x @ gate_weight.T, fp16
    values), each token's top-k in the recipe's order, the shared expert's gate, then the pairs,
    x in fragment order, `out` zeroed and x's `pieces`. x, gate weights: fp16 (`can_route`).
    `done`: an int32 counter, zero between launches (the kernel's last block resets it).
    `router_bias`: fp16 [E] where spec.router_bias."""
    T, H = x.shape
    shared = shared_gate_weight is not None
    pairs, xf = buffers or decode_buffers(T, spec.top_k, spec.num_experts, wpad, x.device)
    routing = routing or routing_buffers(T, spec, shared, x.device)
    variant = variant_of(spec)
    prepared = route_launch(T, H, spec, shared, wpad, done, pairs, xf, routing, pieces, variant)
    prepared(*routed_pointers(x, gate_weight, shared_gate_weight, out, router_bias))
    return pairs, xf, routing


def routed_pointers(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_gate_weight: torch.Tensor | None,
    out: torch.Tensor,
    router_bias: torch.Tensor | None = None,
) -> tuple[int, ...]:
    """What a `route_launch` takes at each call: x, the router's and the shared gate's weights
    (0: none), out and, where the router has one (fp16 [E]), its bias."""
    sgw = 0 if shared_gate_weight is None else shared_gate_weight.contiguous().data_ptr()
    head = (x.contiguous().data_ptr(), gate_weight.contiguous().data_ptr(), sgw, out.data_ptr())
    return head if router_bias is None else (*head, router_bias.contiguous().data_ptr())


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
    variant: registry.Variant = registry.DEFAULT,
) -> launch.Prepared:
    """`prepare_routed`'s launch for T tokens of H into these buffers: `routed_pointers` fill
    its holes (x, router weights, shared gate weights, out [T, H] float32 and, in a build with
    a router bias, the bias) at each call."""
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
        + (np.uint64(routing.scale.data_ptr() if routing.scale is not None else 0), i(slots))
        + (p(pairs.token), p(pairs.weight), p(pairs.expert), p(pairs.lo), p(pairs.hi))
        + (i(wpad), p(xf))
    )
    args = head + (hole, i(T * H)) + px.args + (i(slices),)  # out
    holes: tuple[int, ...] = (0, 3, 5, len(head))
    if variant.router_bias:  # the build's last argument (cuda/route.cu ROUTER_BIAS_ARG)
        args, holes = args + (hole,), holes + (len(args),)
    grid, smem = (blocks + px.blocks,), geometry.group_smem(E)
    name = registry.qualified("route_prep", variant)
    return launch.Prepared(name, grid, (geometry.PREP_THREADS,), args, holes, smem)
