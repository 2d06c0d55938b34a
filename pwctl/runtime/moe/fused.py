"""The experts of one MoE layer, computed from paged planes at per-block widths: grouping of
(token, expert) pairs by expert, then two tensor-core kernels (gate+up with the recipe's gated
activation and biases, then down with its bias and the weighted combine; the shared expert is two
more; the build for the recipe: `variant_of`) that decode labels straight into mma fragments.
Decode (<= 64 tokens) groups on the device and never syncs the host (CUDA graphs); prefill groups
with torch and decodes each weight chunk once into shared memory for up to 128 tokens a pass. One
interface: on the CPU (or with `reference=True`) the same pairs are computed with torch from
`DeviceTable.weight` (the format code), which is what the kernels are tested against. Routing
itself (router GEMM, softmax/top-k) stays in MoEBlock: the same `route` for every path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pwctl.format.recipe import MoESpec
from pwctl.kernels import build, geometry, launch, popc, registry
from pwctl.runtime.memory.device_table import DeviceTable
from pwctl.runtime.moe.activation import ExpertBias, expert_mlp, glu_of
from pwctl.runtime.moe.dispatch import (
    ONE_TOKEN_BITS,
    DispatchRules,
    WidthSpan,
    builds,
    is_popc,
    past_mma,
)
from pwctl.runtime.moe.layouts import TILE_TOKENS, Proj, fragment_order, one_slot_tiles, token_tiles
from pwctl.runtime.moe.pairs import Pairs, all_tokens, decode_buffers, group
from pwctl.runtime.moe.prep import (
    Routing,
    XPieces,
    prepare_decode,
    prepare_prefill,
    route_launch,
    routed_pointers,
    routing_buffers,
    variant_of,
)
from pwctl.runtime.moe.router import route

_NO_SPAN = WidthSpan(0, 0, 0.0, 0.0, 0.0, 0.0)  # `_widths` before its first span
_NO_PIECES = (np.uint64(0),)  # the null x-pieces pointer the lookup kernels are passed
# gate_up's per-tile grid: no shares (runs, scratch rows, tickets)
_NO_RUNS = (np.int32(0), np.uint64(0), np.uint64(0))


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
    def __init__(
        self,
        spec: MoESpec,
        dt: DeviceTable,
        index: dict[tuple[int, int, str], int],
        rules: DispatchRules | None = None,
    ):
        """`index`: (layer, expert, proj) -> block (shared experts: expert = num_experts).
        `rules`: which decode kernels a call takes (default: `DispatchRules()`)."""
        self.spec, self.dt = spec, dt
        # the kernels' build for this model (the torch path runs any activation, on the CPU)
        self.variant = variant_of(spec) if dt.device.type == "cuda" else registry.DEFAULT
        # `_use_bias`'s by layer: (where the model's tensors were, the kernels' fp16 copies)
        self._bias: dict[int, tuple[tuple[int, ...], tuple[torch.Tensor, ...]]] = {}
        self.glu = glu_of(spec)
        experts = spec.num_experts + (1 if spec.has_shared or spec.has_dense else 0)
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
        self._hp: dict[tuple[bool, int, int], torch.Tensor] = {}
        self._decode_buffers: dict[tuple[int, int, int], tuple[Pairs, torch.Tensor]] = {}
        self._routing: dict[tuple[int, bool], Routing] = {}
        on_cuda = dt.device.type == "cuda"  # route_prep's counter, zero between launches
        self._done = torch.zeros(1, dtype=torch.int32, device=dt.device) if on_cuda else None
        if on_cuda:  # every kernel compiled (or found in CuPy's cache) now, while the model loads,
            build.modules(self.variant)  # not in a first request's step (104 s on a fresh H200)
        self._launches: dict[tuple[int, int, bool, str, bool], DecodeLaunch] = {}
        self._run_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
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
        # expert weights one token reads in each layer: what the rules weigh a layer by
        self._reads = {layer: self._weights_a_token(layer) for layer in self.block_ids}
        # prefill kernels: "wgmma" (sm_90a, warpgroup mma) or "mma" (mma.sync, any sm_80+)
        self.prefill_kernel = "wgmma" if dt.device.type == "cuda" and build.has_wgmma() else "mma"
        self._rules = rules or DispatchRules()

    @property
    def rules(self) -> DispatchRules:
        """Which decode kernels a call takes, and their grids' knobs (moe/dispatch.py)."""
        return self._rules

    @rules.setter
    def rules(self, rules: DispatchRules) -> None:
        """New rules; the launches made under the old ones are dropped (A/B runs, tests)."""
        self._rules = rules
        self.forget_launches()

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        index: torch.Tensor,
        shared_scale: torch.Tensor | None = None,
        reference: bool = False,
        path: str | None = None,
        bias: ExpertBias | None = None,
        routed_only: bool = False,
    ) -> torch.Tensor:
        """Sum over routed experts (and the shared one) for tokens x [T, H]: float32 [T, H].
        `path` forces "decode" or "prefill" on CUDA (benchmarks); default: by token count.
        `bias`: the routed experts' biases (the kernels take them in a build with biases).
        `routed_only`: without the shared expert (an expert-parallel owner's rows: their senders
        add it)."""
        T, E = x.shape[0], self.spec.num_experts
        with_shared = self.spec.has_shared and not routed_only
        if reference or not x.is_cuda:
            path = "torch"
        elif path is None:
            path = "decode" if T <= geometry.DECODE_MAX_TOKENS else "prefill"
        if path != "torch":
            self._use_bias(layer, bias)
        if path == "decode":  # one launch groups, zeroes out and lays x out for both kernels
            out = torch.empty(T, x.shape[1], dtype=torch.float32, device=x.device)
            wpad = self.proj[(layer, False, "gate")].wpad
            buffers = self._buffers(T, index.shape[1], wpad, x.device)
            px = self._x_pieces(layer, T, x.device)
            pairs, xf = prepare_decode(x, index, weights, E, wpad, out, buffers, px)
            shared = all_tokens(T, shared_scale, E, x.device) if with_shared else None
            self._decode(layer, xf, pairs, out, shared, px)
            return out
        if path == "torch":
            out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
            self._torch(layer, False, x, group(index, weights, E), out, bias)
            if with_shared:
                self._torch(layer, True, x, all_tokens(T, shared_scale, E, x.device), out)
            return out
        out = torch.empty(T, x.shape[1], dtype=torch.float32, device=x.device)
        pairs, tiles = prepare_prefill(index, weights, E, out)
        self._prefill(layer, False, x, pairs, tiles, out)
        if with_shared:
            shared = all_tokens(T, shared_scale, E, x.device)
            self._prefill(layer, True, x, shared, one_slot_tiles(T, x.device), out)
        return out

    def dense(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP's blocks (spec.has_dense: the shared expert's slot) for every token of
        x [T, H]: float32 [T, H]. On CUDA the prefill kernels on its one slot at any token count
        (the decode launches hold it beside routed experts only; a launch of it alone is not
        built), else the torch path."""
        T, E = x.shape[0], self.spec.num_experts
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        every = all_tokens(T, None, E, x.device)
        if x.is_cuda:
            self._prefill(layer, True, x, every, one_slot_tiles(T, x.device), out)
        else:
            self._torch(layer, True, x, every, out)
        return out

    def routed(
        self,
        layer: int,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        shared_gate_weight: torch.Tensor | None = None,
        router_bias: torch.Tensor | None = None,
        bias: ExpertBias | None = None,
    ) -> tuple[torch.Tensor, Routing]:
        """Router and experts of a call `can_route` accepts: float32 [T, H], and the routing
        chosen. On CUDA one launch routes, groups and lays x out (`prepare_routed`), then the
        decode kernels run; the routing is in buffers the next call of the same token count
        overwrites. On the CPU: torch's router (`route`), then the torch path. `router_bias`,
        `bias`: the router's and the routed experts' biases (GPT-OSS)."""
        if not x.is_cuda:  # the reference: torch's router, then the torch path
            return self._routed_torch(layer, x, gate_weight, shared_gate_weight, router_bias, bias)
        self._use_bias(layer, bias)
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
        route(*routed_pointers(x, gate_weight, shared_gate_weight, out, router_bias))
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
        assert self._done is not None  # on CUDA (`routed` takes the torch path elsewhere)
        route = route_launch(
            T, H, self.spec, shared, wpad, self._done, pairs, xf, routing, px, self.variant
        )
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
        router_bias: torch.Tensor | None,
        bias: ExpertBias | None,
    ) -> tuple[torch.Tensor, Routing]:
        logits = F.linear(x, gate_weight, router_bias)
        weights, index = route(logits, self.spec)
        scale = None
        if shared_gate_weight is not None:
            scale = torch.sigmoid(F.linear(x, shared_gate_weight)).reshape(-1).float()
        out = self(layer, x, weights, index, scale, bias=bias)
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

    def _kernel(self, name: str) -> str:
        """The launch name of kernel `name` in this model's build (`registry.qualified`)."""
        return registry.qualified(name, self.variant)

    def _use_bias(self, layer: int, bias: ExpertBias | None) -> None:
        """Hold `layer`'s expert biases as the kernels read them (a build with biases): fp16,
        gate and up [E, 2, I], down [E, H], made once per layer (their pointers stay fixed for
        the launches kept and CUDA graphs) and copied again only if the model's tensors move.
        A layer's biases are the model's: a call without them takes those held, or none (null
        pointers) before the layer's first call with them."""
        if not self.variant.expert_bias or bias is None:
            return
        key = tuple(t.data_ptr() for t in (bias.gate, bias.up, bias.down))
        if layer in self._bias and self._bias[layer][0] == key:
            return
        half = torch.float16
        gate_up = torch.stack([bias.gate, bias.up], dim=1).to(half).contiguous()
        fresh: tuple[torch.Tensor, ...] = (gate_up, bias.down.to(half).contiguous())
        if layer in self._bias:  # into the copies the kept launches point at
            for mine, new in zip(self._bias[layer][1], fresh, strict=True):
                mine.copy_(new)
            fresh = self._bias[layer][1]
        self._bias[layer] = (key, fresh)

    def _slot_args(self, layer: int, pairs: Pairs, shared: bool = False) -> tuple:
        """The kernels' slot arguments (cuda/planes.cuh SLOT_ARGS): the pairs' and, in a build
        with biases, the layer's bias pointers (null without, and for the `shared` expert's
        slot, which has none)."""
        args = pairs.kernel_args(self.block_ids[layer])
        if not self.variant.expert_bias:
            return args
        held = self._bias.get(layer)
        if held is None or shared:
            return args + (np.uint64(0), np.uint64(0))
        return args + tuple(launch.ptr(t) for t in held[1])

    # --- the torch path: CPU execution and the kernels' reference ------------------------------

    def _torch(
        self,
        layer: int,
        shared: bool,
        x: torch.Tensor,
        pairs: Pairs,
        out: torch.Tensor,
        bias: ExpertBias | None = None,
    ):
        ids = self.block_ids[layer]
        xf = x.float()
        for s in range(pairs.expert.numel()):
            lo, hi = int(pairs.lo[s]), int(pairs.hi[s])
            if hi <= lo:
                continue
            e = int(pairs.expert[s])
            g, u, d = (self.dt.weight(int(b)) for b in ids[e].tolist())
            tok = pairs.token[lo:hi].long()
            b = None
            if bias is not None:
                bg, bu, bd = bias.of(e)
                b = (bg.float(), bu.float(), bd.float())
            y = expert_mlp(xf[tok], g, u, d, self.glu, b)
            out.index_add_(0, tok, y * pairs.weight[lo:hi, None])

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
        follow the rules as they were when each was made (setting `rules` calls this)."""
        self._launches.clear()
        self._routed_plans.clear()
        self._builds.clear()

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
        gu_build, dn_build = builds(kind)
        groups = [(False, pairs)] + ([(True, shared)] if shared is not None else [])
        hp = [self._h(layer, t, p, xf.device) for t, p in groups]
        # the second group's pointers: the routed group again when there is no shared expert
        second = groups[-1][1].slot_args() + (ptr(hp[-1]),)
        common = self.dt.kernel_args() + self._slot_args(layer, pairs)
        xpx = _NO_PIECES  # the lookup kernels take no pieces
        if is_popc(gu_build):  # the popc gate_up x's
            assert px is not None and px.buf is not None  # built by the prep launch
            xpx = (ptr(px.buf),)
        hpx, planes = _NO_PIECES * 2, None
        if is_popc(dn_build):  # each pair's h's 16-bit planes, once a call (popc.cu popc_planes)
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
            self._kernel(f"gate_up_{gu_build}"), plan.gate_up_grid, block,
            common + gu_args + xpx + self._run_args(plan, xf.device),
            early=True,
        )  # fmt: skip
        dn_args = (ptr(hp[0]), np.uint64(0)) + plan.down_routed + second + plan.down_shared  # out
        # down stages while gate_up finishes and waits before it reads h
        down = launch.Prepared(
            self._kernel(f"down_{dn_build}"), plan.down_grid, block, common + dn_args + hpx,
            (len(common) + 1,),
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
        (runtime/engine/decode_graphs.py). Any build reads any width, so a graph captured for other
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
        """`dispatch.past_mma` in `layer`. It sets a one-token gate_up's grid (`_gate_up_runs`),
        so the launches are kept by it too: widths the pager widens reach them."""
        return past_mma(kind, self._widths(layer))

    def _kind(self, layer: int, T: int, px: XPieces | None) -> str:
        """The decode kernels of a call of T tokens (`DispatchRules.decode_kernels`)."""
        return self.rules.decode_kernels(T, self._widths(layer), self._reads[layer], px is not None)

    def _popc_kind(self, layer: int, T: int) -> str | None:
        """The popc kernels' build for a call of T tokens in `layer` (`DispatchRules.popc_kind`),
        or None for the lookup kernels."""
        return self.rules.popc_kind(T, self._widths(layer), self._reads[layer])

    def _widths(self, layer: int) -> WidthSpan:
        """`layer`'s blocks in the widths the kernels read, cached until the next width upload
        (a numpy gather per call is host time on decode)."""
        version, span = self._width_spans.get(layer, (-1, _NO_SPAN))
        if version != self.dt.width_version:
            blocks = self._layer_blocks[layer]
            w = self.dt.synced_width[blocks]
            weights = self._block_weights[blocks]
            past = (geometry.POPC_MAX_BITS, ONE_TOKEN_BITS["p1b5"])

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
        args: tuple = (ptr(s0), i32(p0.wpad), i32(p0.words), i32(s0.shape[0]), ptr(d0))
        args += (ptr(s1), i32(p1.wpad), i32(p1.words), ptr(d1))
        grid: tuple[int, ...] = (
            max(popc.pieces(p.words) for _, p, _ in jobs),
            sum(s.shape[0] for s, _, _ in jobs),
        )
        grid += (geometry.POPC_SPLIT,)
        steps = min(geometry.POPC_STEPS, max(popc.steps(p.words) for _, p, _ in jobs))
        return launch.Prepared(self._kernel("popc_planes"), grid, (32 * steps,), args, early=True)

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
        gu_build, dn_build = builds(kind)
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
        (`geometry.down_groups`, unless the rules' down_one_wave is off)."""
        wave = launch.resident_ctas(self._kernel(f"down_{kind}")) if is_popc(kind) else None
        shared = (dn[1].rows, dn[1].words) if len(dn) > 1 else None
        return geometry.down_groups(
            (dn[0].rows, dn[0].words),
            n_routed,
            shared,
            wave,
            self.rules.down_split,
            self.rules.down_one_wave,
        )

    def _gate_up_runs(
        self, kind: str, tiles: int, shared_tiles: int, past_mma: bool
    ) -> tuple[int, int]:
        """gate_up's persistent CTAs (cuda/lookup.cu Run) in a one-token call of `tiles` routed
        tiles (every slot live) and the shared expert's `shared_tiles`, (routed, shared):
        `gate_up_runs` of them (at most a CTA a half tile), or `geometry.gate_up_runs` on one
        wave of the kernel's CTAs, split by `geometry.gate_up_shares`; (0, 0), one CTA a tile,
        for the other builds and, unless gate_up_runs is set, where a block is wider than the
        build's mma (`past_mma`: DispatchRules.gate_up_runs)."""
        if kind not in ONE_TOKEN_BITS:
            return 0, 0
        ctas = self.rules.gate_up_runs
        if ctas is None and past_mma:
            return 0, 0
        if ctas is None:
            wave = launch.resident_ctas(self._kernel(f"gate_up_{kind}"))
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
        common = self.dt.kernel_args() + self._slot_args(layer, pairs, shared)
        gate_up, down = self._scalars(layer, shared)
        i32, ptr = np.int32, launch.ptr
        rows = geometry.PREFILL_ROWS  # per CTA; gate_up covers h's padded columns
        row_tiles = (-(-32 * dn.wpad // rows["gate_up"]), -(-dn.rows // rows["down"]))
        block = (32 * geometry.PREFILL_WARPS,)
        if self.prefill_kernel == "wgmma" and dn.rows % 2 == 0:  # down adds row pairs
            xt = token_tiles(x, gu.wpad, pairs, tiles, self._kernel("token_tiles"))
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
            launch.launch(self._kernel(name), grid, block, common + args + extra, shared_mem=smem)

    def _down_stream_k(self, dn: Proj) -> int:
        """CTAs of the sm_90a prefill down's stream-K wave (cuda/prefill_wg.cu down_span), or 0 for
        one CTA a (token tile, row tile): `DispatchRules.stream_k`."""
        on = self.rules.stream_k(-(-dn.words // 8))
        return launch.resident_prefill_ctas(self._kernel("down_prefill_wg")) if on else 0
