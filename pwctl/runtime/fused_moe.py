"""The experts of one MoE layer, computed from paged planes at per-block widths: grouping of
(token, expert) pairs by expert on the device, then for decode (<= 16 tokens) two kernels
(gate+up with SiLU(gate)*up, then down with the weighted combine; the shared expert is two more)
and for prefill a dequantize-to-L2-workspace + cuBLAS loop. One interface: on the CPU (or with
`reference=True`) the same pairs are computed with torch from `DeviceTable.weight` (the format
code), which is what the kernels are tested against. Routing itself (router GEMM, softmax/top-k)
stays in MoEBlock: the same `route` for every path."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pwctl.recipe import MoESpec
from pwctl.runtime import kernels
from pwctl.runtime.device_table import DeviceTable

# bytes of fp16 rows dequantized at once: one whole expert matrix of Mixtral-8x7B (117 MB). Measured
# on the H200: 16 MB chunks (L2-resident) made prefill launch-bound (7 launches per matrix).
PREFILL_WORKSPACE = 128 << 20


@dataclass(frozen=True)
class Proj:
    """Static layout of one projection of a layer (all experts of the layer share it)."""

    rows: int
    cols: int
    words: int
    rows_per_table: int

    @property
    def bits_nbytes(self) -> int:
        return self.rows * self.words * 4


@dataclass
class Pairs:
    """(token, expert) pairs sorted by expert, and the slots (one per active expert) over them."""

    token: torch.Tensor  # int32 [pairs]
    weight: torch.Tensor  # float32 [pairs]
    expert: torch.Tensor  # int32 [slots]: expert of each slot (block_ids row)
    lo: torch.Tensor  # int32 [slots]
    hi: torch.Tensor  # int32 [slots]; hi == lo: empty slot

    def kernel_args(self, block_ids: torch.Tensor) -> tuple:
        p = kernels.ptr
        return (p(self.expert), p(self.lo), p(self.hi), p(self.token), p(self.weight), p(block_ids))


def group(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Pairs:
    """Pairs of a routing result, sorted by expert, without a host sync: the slot count is the
    bound min(E, T*k); slots past the number of active experts are empty."""
    T, k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=index.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync (graph capture)
    ends = counts.cumsum(0)
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


def group_on_device(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Pairs:
    """`group` in one kernel launch (decode sizes, CUDA): same pairs, same slots."""
    T, k = index.shape
    n, slots = T * k, min(num_experts, T * k)
    dev = index.device
    i32 = torch.int32
    pairs = Pairs(
        token=torch.empty(n, dtype=i32, device=dev),
        weight=torch.empty(n, dtype=torch.float32, device=dev),
        expert=torch.empty(slots, dtype=i32, device=dev),
        lo=torch.empty(slots, dtype=i32, device=dev),
        hi=torch.empty(slots, dtype=i32, device=dev),
    )
    idx, w = index.to(torch.int64).contiguous(), weights.float().contiguous()
    p = kernels.ptr
    kernels.launch(
        "group_pairs",
        (1,),
        (256,),
        (p(idx), p(w), np.int32(n), np.int32(k), np.int32(num_experts), np.int32(slots))
        + (p(pairs.token), p(pairs.weight), p(pairs.expert), p(pairs.lo), p(pairs.hi)),
        shared_mem=4 * num_experts,
    )
    return pairs


def all_tokens(T: int, scale: torch.Tensor | None, expert: int, device: torch.device) -> Pairs:
    """One slot holding every token (the shared expert), weighted by its gate."""
    i32 = torch.int32
    weight = torch.ones(T, device=device) if scale is None else scale.reshape(-1).float()
    return Pairs(
        token=torch.arange(T, dtype=i32, device=device),
        weight=weight,
        expert=torch.full((1,), expert, dtype=i32, device=device),  # no host copy: graphs
        lo=torch.zeros(1, dtype=i32, device=device),
        hi=torch.full((1,), T, dtype=i32, device=device),
    )


NIBBLE_ORDER = [0, 4, 2, 6, 1, 5, 3, 7]  # column of nibble n within 8 (3-bit reversal)


def plane_order(x: torch.Tensor, words: int) -> torch.Tensor:
    """[n, K] -> float32 [n, 8, words, 4] (cuda/moe.cu's input layout), zero-padded to 32*words:
    [q, w, i] holds column 32w + 8(q // 2) + NIBBLE_ORDER[4(q % 2) + i]."""
    n, K = x.shape
    xp = x.float()
    if 32 * words > K:
        xp = F.pad(xp, (0, 32 * words - K))
    # NIBBLE_ORDER is the 3-bit reversal: reverse the three binary axes of each group of 8
    # (view ops only: no index tensor, so CUDA-graph capture works)
    xp = xp.view(n, words, 4, 2, 2, 2).permute(0, 1, 2, 5, 4, 3)
    return xp.reshape(n, words, 8, 4).transpose(1, 2).contiguous()


class FusedMoE:
    def __init__(self, spec: MoESpec, dt: DeviceTable, index: dict[tuple[int, int, str], int]):
        """`index`: (layer, expert, proj) -> block (shared experts: expert = num_experts)."""
        if spec.act != "silu":
            raise ValueError(f"activation {spec.act}: the kernels implement silu")
        self.spec, self.dt = spec, dt
        experts = spec.num_experts + (1 if spec.has_shared else 0)
        self.block_ids: dict[int, torch.Tensor] = {}
        self.proj: dict[tuple[int, bool, str], Proj] = {}
        for layer in sorted({key[0] for key in index}):
            ids = [[index[(layer, e, p)] for p in ("gate", "up", "down")] for e in range(experts)]
            self.block_ids[layer] = torch.tensor(ids, dtype=torch.int32, device=dt.device)
            for e, shared in ((0, False), (spec.num_experts, True)):
                if (layer, e, "gate") not in index:
                    continue
                for p in ("gate", "up", "down"):
                    b = dt.blocks[index[(layer, e, p)]]
                    self.proj[(layer, shared, p)] = Proj(b.rows, b.cols, b.words, b.rows_per_table)
        self._hp: dict[tuple[int, int], torch.Tensor] = {}

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
        T = x.shape[0]
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        if reference or not x.is_cuda:
            path = "torch"
        elif path is None:
            path = "decode" if T <= kernels.DECODE_MAX_TOKENS else "prefill"
        run = {"torch": self._torch, "decode": self._decode, "prefill": self._prefill}[path]
        E = self.spec.num_experts
        pairs = group_on_device(index, weights, E) if path == "decode" else group(index, weights, E)
        run(layer, False, x, pairs, out)
        if self.spec.has_shared:
            run(layer, True, x, all_tokens(T, shared_scale, E, x.device), out)
        return out

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

    # --- decode: two kernels per expert group ---------------------------------------------------

    def _decode(self, layer: int, shared: bool, x: torch.Tensor, pairs: Pairs, out: torch.Tensor):
        gu, dn = self.proj[(layer, shared, "gate")], self.proj[(layer, shared, "down")]
        T, n_pairs, n_slots = x.shape[0], pairs.token.numel(), pairs.expert.numel()
        tile = kernels.token_tile(T)
        rows_per_block = kernels.WARPS * kernels.ROWS[tile]
        xp = plane_order(x, gu.words)
        key = (n_pairs, dn.words)
        if key not in self._hp:  # padding columns are never written: zero once, reuse
            self._hp[key] = torch.zeros(n_pairs, 8, dn.words, 4, device=x.device)
        hp = self._hp[key]
        common = self.dt.kernel_args() + pairs.kernel_args(self.block_ids[layer])
        i32, i64 = np.int32, np.int64
        kernels.launch(
            f"gate_up_t{tile}",
            (-(-gu.rows // rows_per_block), n_slots),
            (32 * kernels.WARPS,),
            common
            + (kernels.ptr(xp), kernels.ptr(hp), i32(gu.rows), i32(gu.words), i32(dn.words))
            + (i64(gu.bits_nbytes), i32(gu.rows_per_table)),
        )
        kernels.launch(
            f"down_t{tile}",
            (-(-dn.rows // rows_per_block), n_slots),
            (32 * kernels.WARPS,),
            common
            + (kernels.ptr(hp), kernels.ptr(out), i32(dn.rows), i32(dn.words))
            + (i64(dn.bits_nbytes), i32(dn.rows_per_table)),
        )

    # --- prefill: dequantize row chunks into an L2-sized workspace, multiply with cuBLAS --------

    def _prefill(self, layer: int, shared: bool, x: torch.Tensor, pairs: Pairs, out: torch.Tensor):
        ids = self.block_ids[layer].tolist()
        gu, dn = self.proj[(layer, shared, "gate")], self.proj[(layer, shared, "down")]
        x16 = x.half()
        los, his, experts = pairs.lo.tolist(), pairs.hi.tolist(), pairs.expert.tolist()
        for lo, hi, e in zip(los, his, experts, strict=True):
            if hi <= lo:
                continue
            tok = pairs.token[lo:hi].long()
            xe = x16[tok]
            g = self._rows_matmul(ids[e][0], gu, xe)
            u = self._rows_matmul(ids[e][1], gu, xe)
            h = (F.silu(g) * u).half()
            y = self._rows_matmul(ids[e][2], dn, h)
            out.index_add_(0, tok, y * pairs.weight[lo:hi, None])

    def _rows_matmul(self, block: int, proj: Proj, x16: torch.Tensor) -> torch.Tensor:
        """x16 [n, cols] @ W.T, W dequantized a chunk of rows at a time: float32 [n, rows]."""
        chunk = max(1, min(proj.rows, PREFILL_WORKSPACE // (2 * proj.cols)))
        ws = torch.empty(chunk, proj.cols, dtype=torch.float16, device=x16.device)
        y = torch.empty(x16.shape[0], proj.rows, dtype=torch.float32, device=x16.device)
        args = self.dt.kernel_args()
        for r0 in range(0, proj.rows, chunk):
            n = min(chunk, proj.rows - r0)
            kernels.launch(
                "dequant_rows",
                (n,),
                (128,),
                args
                + (np.int32(block), np.int64(proj.bits_nbytes), np.int32(proj.words))
                + (np.int32(proj.cols), np.int32(proj.rows_per_table), np.int32(r0))
                + (kernels.ptr(ws),),
            )
            y[:, r0 : r0 + n] = torch.mm(x16, ws[:n].T).float()
        return y
