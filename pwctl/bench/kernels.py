"""`pwctl bench --kernels`: the fused MoE kernels on real layer shapes with synthetic planes and
tables generated on the GPU (random labels, random sorted tables), paged over shuffled slabs like a
pager leaves them. Per shape x width x tokens: time, bytes read, GB/s, % of the device-to-device
copy bandwidth measured in the same run, and speedups over the FP16 floor (fp16 bytes / copy
bandwidth) and over a fused FP16 grouped GEMM timed in the same run. The tests build their layers
with the same `synthetic_layer`."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from pwctl.build.convert import ConvertOptions, rows_per_table
from pwctl.errors import PwctlError
from pwctl.format.bitplanes import bits_nbytes, words_per_row
from pwctl.format.pack import BlockInfo, PlaneInfo
from pwctl.format.recipe import CLAMPED_SWIGLU, MoESpec
from pwctl.kernels.geometry import DECODE_MAX_TOKENS, POPC_MAX_TOKENS
from pwctl.runtime.memory.device_table import DeviceTable
from pwctl.runtime.memory.page_table import GPU, PageTable, choose_slab, min_slab
from pwctl.runtime.moe.activation import ExpertBias
from pwctl.runtime.moe.dispatch import DispatchRules
from pwctl.runtime.moe.fused import FusedMoE
from pwctl.runtime.moe.router import route


def _spec(
    hidden,
    inter,
    experts,
    top_k,
    shared=0,
    order="softmax_topk",
    norm=False,
    act="silu",
    bias=False,
) -> MoESpec:
    """A layer's MoESpec; `bias`: router and experts with biases (GPT-OSS)."""
    return MoESpec(
        experts, top_k, inter, hidden, order, norm, 1.0, shared, shared > 0, act, bias, bias
    )


SHAPES = {  # one layer of each: Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, OLMoE-1B-7B
    "mixtral": _spec(4096, 14336, 8, 2, norm=True),
    "qwen-moe": _spec(2048, 1408, 60, 4, shared=5632),
    "qwen3-moe": _spec(2048, 768, 128, 8, norm=True),
    "olmoe": _spec(2048, 1024, 64, 8),
    # openai/gpt-oss-20b config.json (as issue 65 quotes it): hidden_size 2880,
    # intermediate_size 2880, num_local_experts 32, num_experts_per_tok 4 (24 layers); top-k of
    # the logits then softmax, clamped SwiGLU (alpha 1.702, limit 7.0), biased router and experts
    "gpt-oss-20b": _spec(2880, 2880, 32, 4, order="topk_softmax", act=CLAMPED_SWIGLU, bias=True),
    # google/gemma-4-26B-A4B config.json (text_config): hidden_size 2816, moe_intermediate_size
    # 704, num_experts 128, top_k_experts 8 (softmax, top-k, renormalised), hidden_activation
    # gelu_pytorch_tanh, 30 layers; checked 2026-12-06 against public copies of the published
    # file (transformers' Gemma4TextConfig has no MoE defaults). The routed experts only: the
    # dense MLP beside them (intermediate_size 2112) runs its own launches (FusedMoE.dense), and
    # the router is a module of its own reading the residual stream (never route_prep).
    "gemma4-26b-a4b": _spec(2816, 704, 128, 8, norm=True, act="gelu_pytorch_tanh"),
}


def layer_blocks(spec: MoESpec, max_bits: int, min_bits: int) -> list[BlockInfo]:
    """BlockInfo of every block of one layer (layer 0), pack order: expert-major, gate/up/down."""
    blocks = []
    experts = [(e, spec.intermediate, False) for e in range(spec.num_experts)]
    if spec.has_shared:
        experts.append((spec.num_experts, spec.shared_intermediate, True))
    for e, inter, shared in experts:
        for proj, rows, cols in (("gate", inter, spec.hidden), ("up", inter, spec.hidden)) + (
            ("down", spec.hidden, inter),
        ):
            words = words_per_row(cols)
            rpt = rows_per_table(rows, cols, ConvertOptions.table_group)
            tables = [(rows // rpt) * 2 ** (p + 2) * (p + 1 >= min_bits) for p in range(max_bits)]
            planes = [PlaneInfo(0, bits_nbytes(rows, words), n, 0) for n in tables]
            name = f"layers.0.experts.{e}.{proj}"
            blocks.append(BlockInfo(name, 0, e, shared, proj, rows, cols, words, rpt, "", planes))
    return blocks


@dataclass
class SyntheticLayer:
    spec: MoESpec
    blocks: list[BlockInfo]
    table: PageTable
    dt: DeviceTable
    moe: FusedMoE
    bias: ExpertBias | None = None  # random fp16 expert biases where spec.expert_bias

    def set_widths(self, widths: np.ndarray) -> None:
        self.table.width[:] = widths
        self.dt.sync()


BENCH_BITS = (2, 8)  # the synthetic layers' widths (synthetic_layer's defaults)
MAX_BENCH_TOKENS = 16384  # tokens of one bench call (a Mixtral layer's prefill: ~1 GB of x and h)


def synthetic_layer(
    spec: MoESpec,
    device: str = "cuda",
    min_bits: int = BENCH_BITS[0],
    max_bits: int = BENCH_BITS[1],
    seed: int = 0,
    slab_bytes: int | None = None,
    rules: DispatchRules | None = None,
) -> SyntheticLayer:
    """Every block of one layer at `max_bits` planes, resident in a shuffled slab arena (slabs of
    `slab_bytes`, at least a group of rows of plane words; default: the pager's choice), its
    kernels chosen by `rules` (default: `DispatchRules()`)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = layer_blocks(spec, max_bits, min_bits)
    pb = np.array([[p.nbytes for p in b.planes] for b in blocks], dtype=np.int64)
    slab = slab_bytes or choose_slab(pb, min_slab(blocks))
    total = int((-(-pb // slab)).sum())
    table = PageTable(pb, min_bits, total * slab, slab)
    linear = torch.randint(-(2**31), 2**31 - 1, (total * slab // 4,), generator=gen, device=device)
    linear = linear.to(torch.int32).view(torch.uint8)
    for b, blk in enumerate(blocks):
        for p in range(min_bits - 1, max_bits):
            start = int(table.slab_off[b, p]) * slab + blk.planes[p].bits_nbytes
            n = blk.planes[p].table_nbytes // 2
            tab = torch.randn(n // 2 ** (p + 1), 2 ** (p + 1), generator=gen, device=device)
            tab = (tab.sort(dim=1).values * 0.02).half().view(torch.uint8).reshape(-1)
            linear[start : start + 2 * n] = tab
    perm = np.random.default_rng(seed).permutation(total).astype(np.int32)
    table.slab_map[:] = perm
    table.state[:] = GPU
    table.width[:] = max_bits
    table.wanted[:] = max_bits
    arena = torch.empty(total, slab, dtype=torch.uint8, device=device)
    where = torch.as_tensor(perm, dtype=torch.int64, device=device)
    arena.index_copy_(0, where, linear.view(-1, slab))
    dt = DeviceTable(table, arena, blocks)
    index = {(0, b.expert, b.proj): i for i, b in enumerate(blocks)}
    bias = random_bias(spec, device, seed) if spec.expert_bias else None
    return SyntheticLayer(spec, blocks, table, dt, FusedMoE(spec, dt, index, rules), bias)


def random_bias(spec: MoESpec, device: str = "cuda", seed: int = 0) -> ExpertBias:
    """Random fp16 expert biases (x 0.05) of one layer: gate, up [E, I], down [E, H]."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def rows(n: int) -> torch.Tensor:
        return (torch.randn(spec.num_experts, n, generator=gen, device=device) * 0.05).half()

    return ExpertBias(rows(spec.intermediate), rows(spec.intermediate), rows(spec.hidden))


def random_routing(spec: MoESpec, T: int, device: str = "cuda", seed: int = 0):
    """Tokens x [T, H], routing weights/indices and shared-expert gate scale, for a bench/test."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, spec.hidden, generator=gen, device=device)
    logits = torch.randn(T, spec.num_experts, generator=gen, device=device)
    weights, index = route(logits, spec)
    scale = None
    if spec.has_shared:
        scale = torch.sigmoid(torch.randn(T, 1, generator=gen, device=device))
    return x, weights, index, scale


def decode_calls(shapes: list[str], tokens: list[int], width: int = 4, path: str = "decode"):
    """(shape, T, call) per shape and token count: the decode call (or another `path` of
    `FusedMoE.__call__`) of a synthetic layer at `width` bits on random routing (the profiling
    recipes' subjects). The generator drops its reference to a shape's layer after the shape's
    last call; the caller's last `call` holds the layer until the next one replaces it."""
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=0)
        layer.set_widths(np.full(layer.table.n_blocks, width))
        for T in tokens:
            x, w, idx, sc = random_routing(layer.spec, T, seed=T)
            call = functools.partial(layer.moe, 0, x, w, idx, sc, path=path, bias=layer.bias)
            yield name, T, call
        del layer
        torch.cuda.empty_cache()


def router_weights(
    spec: MoESpec, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A random fp16 router (x 0.05), with a shared expert its gate's row and, where the spec
    has one, the router's bias."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gw = (torch.randn(spec.num_experts, spec.hidden, generator=gen, device="cuda") * 0.05).half()
    sgw = rb = None
    if spec.has_shared:
        sgw = (torch.randn(1, spec.hidden, generator=gen, device="cuda") * 0.05).half()
    if spec.router_bias:
        rb = (torch.randn(spec.num_experts, generator=gen, device="cuda") * 0.5).half()
    return gw, sgw, rb


def routed_call(call):
    """The same layer and token count as a `decode_calls` call, with a random fp16 router in the
    first launch instead of given routing (`FusedMoE.routed`)."""
    return routed_on(call.func, call.args[1], bias=call.keywords.get("bias"))


def routed_on(moe: FusedMoE, x: torch.Tensor, seed: int = 0, bias: ExpertBias | None = None):
    """`moe.routed` on layer 0's tokens x with `router_weights(seed)` and the experts' `bias`."""
    return functools.partial(moe.routed, 0, x.half(), *router_weights(moe.spec, seed), bias)


# --- timing ------------------------------------------------------------------------------------


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph, after three warm-up calls on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_time(fn, iters: int = 50) -> float:
    """Seconds per call of `fn` replayed as a CUDA graph (launch overhead excluded)."""
    return event_time(capture_graph(fn).replay, iters)


def event_time(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


@functools.cache
def l2_flush() -> torch.Tensor:
    """A buffer 4x the GPU's L2 (at least 64 MB): reading it evicts whatever a call left there."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return torch.ones(max(4 * l2, 64 << 20), dtype=torch.uint8, device="cuda")


def cold_time(fn, iters: int = 30) -> float:
    """Median seconds of one call of `fn` with nothing of it in L2: each call is timed alone
    after a read of `l2_flush` (queued first, so the call does not wait for the host). What a
    decode step finds of one layer, whose weights 40-odd other layers' have evicted: replayed
    back to back, a small layer stays in L2 (a Qwen3-MoE token reads 20 MB; the H200 holds 50)
    and took 27.8 us against 35.1 cold (docs/decisions/030-bench-method.md)."""
    flush = l2_flush()
    fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]  # fmt: skip
    for start, end in pairs:
        flush.sum(dtype=torch.int32)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3


def _median_time(fn, iters: int, repeats: int = 5) -> float:
    """The median of `repeats` event-timed runs of `iters` calls: one run of a few multi-ms calls
    moved by up to 10% between runs (Mixtral prefill on the H200)."""
    return statistics.median(event_time(fn, iters) for _ in range(repeats))


def host_time(fn, iters: int = 200) -> float:
    """Seconds per call of `fn` from the host's side: back-to-back calls, one sync at the end.
    While the GPU keeps up, this is the host's own cost a call (the eager engine's pace)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second (the convention of the
    4.28 TB/s quoted for the H200), the DRAM traffic rate a reading kernel is compared with."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * nbytes / event_time(lambda: b.copy_(a), 20)


class GroupedFp16:
    """The FP16 baseline: the same experts as dense 16-bit weights, torch._grouped_mm over the
    pairs sorted by expert (`grouped` False: a loop of one cuBLAS GEMM an expert, also where
    grouped_mm is missing or refuses), and a shared expert's two dense GEMMs times `scale` (its
    gate), as an FP16 MoE layer serves. On CUDA the weights are bf16 (the same bytes): torch
    2.11's grouped_mm runs its fused kernel for bf16 on the H200, and for fp16 a host loop of
    GEMMs at 512 tokens (Qwen3-MoE: 4.0 ms of host time a call;
    docs/decisions/030-bench-method.md). The routing is read on the host once, here, so both forms
    replay from a CUDA graph."""

    def __init__(self, layer: SyntheticLayer, x, weights, index, scale=None):
        spec, dt = layer.spec, layer.dt
        if spec.has_shared and scale is None:
            raise ValueError("a layer with a shared expert needs its gate's scale")
        dtype = torch.bfloat16 if x.is_cuda else torch.float16
        self.x = x.to(dtype)
        self.T, self.k = index.shape
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        self.tok, self.w = order // self.k, weights.reshape(-1)[order]
        experts = flat.unique().tolist()
        counts = torch.bincount(flat, minlength=spec.num_experts)[experts]
        self.offs = counts.cumsum(0).to(torch.int32)
        self.bounds = [0] + self.offs.tolist()
        ids = layer.moe.block_ids[0]

        def stack(es, j):
            return torch.stack([dt.weight(int(ids[e, j])).to(dtype) for e in es])

        self.gu = torch.cat([stack(experts, 0), stack(experts, 1)], dim=1).transpose(1, 2)
        self.dn = stack(experts, 2).transpose(1, 2)  # gu: [n, H, 2I], dn: [n, I, H]
        self.I = spec.intermediate
        self.shared = None  # (gate and up [H, 2I'], down [I', H], scale [T, 1])
        if spec.has_shared:
            e = [spec.num_experts]
            gu = torch.cat([stack(e, 0), stack(e, 1)], dim=1)[0].T
            self.shared = (gu, stack(e, 2)[0].T, scale.reshape(-1, 1).to(dtype))
        self.grouped = hasattr(torch, "_grouped_mm")

    def _mm(self, a, b):
        if self.grouped:
            try:
                return torch._grouped_mm(a, b, offs=self.offs)
            except (RuntimeError, TypeError):
                self.grouped = False
        bounds = self.bounds
        return torch.cat([a[bounds[i] : bounds[i + 1]] @ b[i] for i in range(len(bounds) - 1)])

    def __call__(self):
        xs = self.x[self.tok]
        gu = self._mm(xs, self.gu)
        h = F.silu(gu[:, : self.I]) * gu[:, self.I :]
        y = self._mm(h, self.dn) * self.w[:, None].to(gu.dtype)
        out = torch.zeros(self.T, self.x.shape[1], device=y.device, dtype=y.dtype)
        out.index_add_(0, self.tok, y)
        if self.shared is not None:
            gu_s, dn_s, scale = self.shared
            g = self.x @ gu_s
            i = dn_s.shape[0]
            out += ((F.silu(g[:, :i]) * g[:, i:]) @ dn_s * scale).to(out.dtype)
        return out


@dataclass
class KernelRow:
    shape: str
    width: str
    tokens: int
    # decode (routing given, graph-replayed, the launcher's kernels), popc / lookup (the same, one
    # kernel family), routed (the router in the first launch: the engine's call), prefill
    path: str
    time_us: float  # decode paths: L2 flushed before each call (`cold_time`); prefill: eager
    bytes_read: int
    gb_s: float
    pct_copy: float
    fp16_floor_us: float
    speedup_vs_floor: float
    fp16_grouped_us: float
    speedup_vs_grouped: float
    warm_us: float  # decode paths: graph replays back to back (a small layer stays in L2)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Target:
    """One of the kernel issue's speed targets: the rows it covers and the bar they must clear."""

    name: str
    field: str  # a KernelRow field
    bar: float
    path: str
    widths: tuple[str, ...] | None  # None: any width
    tokens: tuple[int, int]  # inclusive range

    def covers(self, r: KernelRow) -> bool:
        lo, hi = self.tokens
        return (
            r.path == self.path
            and lo <= r.tokens <= hi
            and (self.widths is None or r.width in self.widths)
        )


TARGETS = (  # decode: the whole layer, its router included (the `routed` rows)
    Target("1-4 tokens, 3-4 bits: % of copy bandwidth", "pct_copy", 70.0, "routed", ("3", "4"),
           (1, 4)),
    Target("1-4 tokens, 4 bits: x FP16 floor", "speedup_vs_floor", 2.5, "routed", ("4",), (1, 4)),
    Target("1-4 tokens, 4 bits: x FP16 grouped GEMM", "speedup_vs_grouped", 2.5, "routed", ("4",),
           (1, 4)),
    Target("prefill 512+ tokens: x FP16 grouped GEMM", "speedup_vs_grouped", 1 / 1.5, "prefill",
           None, (512, 1 << 30)),
)  # fmt: skip


def against_targets(rows: list[KernelRow]) -> list[dict]:
    """Per target and shape: the worst and best measured value of the rows it covers, and whether
    the worst clears the bar (benchmark targets, not tests)."""
    out = []
    for t in TARGETS:
        for shape in dict.fromkeys(r.shape for r in rows):
            vals = [getattr(r, t.field) for r in rows if r.shape == shape and t.covers(r)]
            if vals:
                out.append({"target": t.name, "shape": shape, "bar": t.bar, "worst": min(vals),
                            "best": max(vals), "met": min(vals) >= t.bar})  # fmt: skip
    return out


def active_bytes(layer: SyntheticLayer, index: torch.Tensor) -> tuple[int, int]:
    """(plane bytes at the widths in use, fp16 bytes) of the blocks a routing reads."""
    experts = set(index.reshape(-1).tolist())
    if layer.spec.has_shared:
        experts.add(layer.spec.num_experts)
    planes = fp16 = 0
    for b, blk in enumerate(layer.blocks):
        if blk.expert in experts:
            planes += blk.bytes_at(int(layer.table.width[b]))
            fp16 += blk.fp16_bytes
    return planes, fp16


def _measure(layer: SyntheticLayer, name: str, width: str, T: int, copy_bw: float, seed: int):
    """One row per path that takes T tokens: decode (CUDA-graph replay: launch overhead out; timed
    with L2 flushed, and back to back) up to 64 tokens, prefill from 4 tokens on (the crossover is
    chosen from these rows; the FP16 grouped GEMM is timed as the rows' path is). Up to
    POPC_MAX_TOKENS tokens `decode` is the launcher's choice (rules' popc_decode None) and both
    kernel families get a row of their own: `popc` (binary tensor cores for one-token slots)
    where rows allow, and `lookup`. Up to 64 tokens, `routed`: the whole layer with its router
    (`_routed_row`), the rows the decode targets cover."""
    x, weights, index, scale = random_routing(layer.spec, T, seed=seed + T)
    planes, fp16 = active_bytes(layer, index)
    grouped = GroupedFp16(layer, x, weights, index, scale)
    tg = grouped_time(grouped)
    rows, rules = [], layer.moe.rules
    forced = {"decode": None, "popc": True, "lookup": False}
    for path in ("decode", "popc", "lookup", "prefill"):
        if (path == "decode" and T > DECODE_MAX_TOKENS) or (path == "prefill" and T < 4):
            continue
        if path in ("popc", "lookup") and T > POPC_MAX_TOKENS:  # where the popc kernels run
            continue

        layer.moe.rules = replace(rules, popc_decode=forced.get(path))

        def call(path=path):
            kind = "prefill" if path == "prefill" else "decode"
            return layer.moe(0, x, weights, index, scale, path=kind, bias=layer.bias)

        if path == "prefill":
            t = warm = _median_time(call, 5)
            tp = grouped_time(grouped, decode=False) if T <= DECODE_MAX_TOKENS else tg
        else:
            t, warm, tp = *graph_times(call), tg
        layer.moe.rules = rules  # as the caller had it
        rows.append(_row(name, width, T, path, t, warm, planes, fp16, tp, copy_bw))
    if T <= DECODE_MAX_TOKENS:
        rows.append(_routed_row(layer, name, width, x, copy_bw, seed))
    return rows


def grouped_time(grouped: GroupedFp16, decode: bool | None = None) -> float:
    """Seconds a call of the FP16 baseline, timed as the rows it is set against: the fastest of
    its two forms (grouped_mm, a GEMM an expert), for prefill rows eagerly and warm, for decode
    rows (default: up to DECODE_MAX_TOKENS tokens) with L2 cold as they are, each eagerly and
    replayed from a graph. No one way wins everywhere on the H200
    (docs/decisions/030-bench-method.md): eagerly a call is host-bound on many experts (Qwen3-MoE
    one token: 479 us, its kernels 64), and fp16 grouped_mm replayed from a graph took 1910 us on
    Mixtral's one token against 301 eagerly; the loop's graph took 197."""
    if decode is None:
        decode = grouped.T <= DECODE_MAX_TOKENS
    grouped()  # settles grouped_mm or the loop before any capture
    forms = [True, False] if grouped.grouped else [False]
    times = []
    for form in forms:
        grouped.grouped = form
        if not decode:
            times.append(_median_time(grouped, 10))
        else:
            times += [cold_time(grouped), graph_times(grouped)[0]]
    grouped.grouped = forms[0]
    return min(times)


def graph_times(call) -> tuple[float, float]:
    """(cold, warm) seconds of one graph replay of `call`."""
    replay = capture_graph(call).replay
    return cold_time(replay), event_time(replay)


def _row(name, width, T, path, t, warm, planes, fp16, tg, copy_bw) -> KernelRow:
    floor = fp16 / copy_bw
    return KernelRow(
        name, width, T, path, t * 1e6, planes, planes / t / 1e9, 100 * planes / t / copy_bw,
        floor * 1e6, floor / t, tg * 1e6, tg / t, warm * 1e6,
    )  # fmt: skip


def _routed_row(layer: SyntheticLayer, name, width, x, copy_bw, seed) -> KernelRow:
    """The engine's call, the whole layer: a random fp16 router in the first launch
    (`FusedMoE.routed`, the launcher's choice of kernels), graph-replayed. Its bytes, FP16 floor
    and FP16 baseline are those of the experts it routes to."""
    call = routed_on(layer.moe, x, seed, layer.bias)
    _, routing = call()
    planes, fp16 = active_bytes(layer, routing.index)
    tg = grouped_time(GroupedFp16(layer, x, routing.weights, routing.index, routing.scale))
    t, warm = graph_times(call)
    return _row(name, width, x.shape[0], "routed", t, warm, planes, fp16, tg, copy_bw)


def check_args(shapes: list[str], widths: list[str], tokens: list[int]) -> None:
    """`bench --kernels`' shapes, widths ("mixed", or BENCH_BITS' range: `synthetic_layer`'s
    planes) and token counts, refused before any GPU work."""
    bad = sorted(set(shapes) - set(SHAPES))
    if bad:
        raise PwctlError(f"unknown --shape {bad}; choose from {sorted(SHAPES)}")
    lo, hi = BENCH_BITS
    for w in widths:
        if w != "mixed" and not (w.isdigit() and lo <= int(w) <= hi):
            raise PwctlError(f"bad --width '{w}': a width in {lo}..{hi}, or mixed")
    for T in tokens:
        if not 1 <= T <= MAX_BENCH_TOKENS:
            raise PwctlError(f"bad --tokens {T}: 1..{MAX_BENCH_TOKENS} tokens a call")


def run_kernel_bench(
    shapes: list[str],
    widths: list[str],
    tokens: list[int],
    seed: int = 0,
    on_row: Callable[[KernelRow], None] | None = None,
) -> tuple[float, list[KernelRow]]:
    """Every shape x width x token count; `on_row` sees each row as soon as it is measured (a
    run cut short by a time limit still reports what it got)."""
    copy_bw = copy_bandwidth()
    rows = []
    for name in shapes:
        layer = synthetic_layer(SHAPES[name], seed=seed)
        rng = np.random.default_rng(seed)
        t = layer.table
        for width in widths:
            if width == "mixed":
                w = rng.integers(t.min_bits, t.max_bits + 1, t.n_blocks)
            else:
                w = np.full(t.n_blocks, int(width))
            layer.set_widths(w)
            for T in tokens:
                for row in _measure(layer, name, width, T, copy_bw, seed):
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
        del layer
        torch.cuda.empty_cache()
    return copy_bw, rows


ROW_COLUMNS = ("shape", "width", "tokens", "path", "us", "warm us", "MB read", "GB/s", "% copy",
               "x fp16 floor", "x fp16 grouped")  # fmt: skip


def row_cells(r: KernelRow) -> tuple[str, ...]:
    """One row of the `bench --kernels` table (also its progress line)."""
    return (r.shape, r.width, str(r.tokens), r.path, f"{r.time_us:.1f}", f"{r.warm_us:.1f}",
            f"{r.bytes_read / 1e6:.1f}", f"{r.gb_s:.0f}", f"{r.pct_copy:.0f}",
            f"{r.speedup_vs_floor:.2f}", f"{r.speedup_vs_grouped:.2f}")  # fmt: skip


TARGET_COLUMNS = ("target", "shape", "bar", "worst", "best", "met")


def target_cells(c: dict) -> tuple[str, ...]:
    return (c["target"], c["shape"], f"{c['bar']:.2f}", f"{c['worst']:.2f}", f"{c['best']:.2f}",
            "yes" if c["met"] else "no")  # fmt: skip
