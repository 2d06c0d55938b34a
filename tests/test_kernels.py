"""The fused MoE path: grouping, the plane-order layout and the torch path (CPU) against the
ExpertStore reference; the CUDA kernels against the torch path on real layer shapes (GPU)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import math
import re
import sys
import threading
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pwctl.bench.kernels import (
    SHAPES,
    TARGETS,
    KernelRow,
    against_targets,
    random_routing,
    synthetic_layer,
)
from pwctl.format.bitplanes import pack_planes
from pwctl.format.pack import Pack
from pwctl.format.recipe import CLAMPED_SWIGLU, MoESpec
from pwctl.kernels import build, geometry, launch, popc, registry
from pwctl.kernels.popc import popc_matvec, quantize, step_words, subset_coefficients
from pwctl.runtime.memory.device_table import DeviceTable
from pwctl.runtime.memory.expert_store import ExpertStore
from pwctl.runtime.memory.page_table import PageTable
from pwctl.runtime.memory.pager import CpuBackend, Pager
from pwctl.runtime.moe import layouts
from pwctl.runtime.moe.dispatch import DispatchRules
from pwctl.runtime.moe.fused import FusedMoE
from pwctl.runtime.moe.layouts import fragment_order, tile_plan, wgmma_order, wgmma_tiles
from pwctl.runtime.moe.pairs import Pairs, all_tokens, decode_buffers, group
from pwctl.runtime.moe.prep import XPieces, prepare_decode, prepare_prefill, prepare_routed
from pwctl.runtime.moe.router import route


def test_group_sorts_pairs_by_expert():
    gen = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    pairs = group(index, weights, 6)
    seen = set()
    for s in range(pairs.expert.numel()):
        lo, hi, e = int(pairs.lo[s]), int(pairs.hi[s]), int(pairs.expert[s])
        for i in range(lo, hi):
            t = int(pairs.token[i])
            slot = (index[t] == e).nonzero().item()
            assert float(pairs.weight[i]) == float(weights[t, slot])
            seen.add((t, e))
    assert seen == {(t, int(e)) for t in range(5) for e in index[t]}
    assert int((pairs.hi > pairs.lo).sum()) == len(set(index.flatten().tolist()))


def test_decode_tiles_cover_every_decode_token_count():
    # the smallest compiled tile that holds T tokens, for every T the decode path takes, and an
    # entry (gate_up<NT>, down<NT>) in the registry for every tile the launcher may name
    for T in range(1, geometry.DECODE_MAX_TOKENS + 1):
        nt = geometry.n_tiles(T)
        smaller = [n for n in geometry.DECODE_TILES if n < nt]
        assert 8 * nt >= T and all(8 * n < T for n in smaller)
    with pytest.raises(ValueError, match="at most 64"):
        geometry.n_tiles(geometry.DECODE_MAX_TOKENS + 1)
    for kind in ("gate_up", "down"):
        bodies = {k.body for k in registry.KERNELS if k.name.startswith(f"{kind}_n")}
        assert bodies == {f"{kind}<{nt}>" for nt in geometry.DECODE_TILES}


def test_launchers_size_the_grouping_as_the_kernels_do():
    """group_smem follows cuda/prep.cu: prefill_prep groups with every warp of its block from
    GROUP_SPLIT pairs on, with one warp below (and in the decode preps). The program defines
    both from the geometry, and the source defines neither itself."""
    src = build.part_source(registry.PART_OF["prefill_prep"])
    define = {m[0]: int(m[1]) for m in re.findall(r"^#define (\w+) (\d+)", src, re.MULTILINE)}
    assert define["GROUP_SPLIT"] == geometry.GROUP_SPLIT
    assert define["PREP_THREADS"] == geometry.PREP_THREADS
    sources = "".join(p.read_text() for p in build.included(["prep.cu"], build.cuda_dir()))
    assert not re.search(r"^#define (GROUP_SPLIT|PREP_THREADS) ", sources, re.MULTILINE)
    split = geometry.GROUP_SPLIT
    assert geometry.group_smem(60, split) == 4 * 60 * (geometry.PREP_THREADS // 32)
    assert geometry.group_smem(60, split - 1) == geometry.group_smem(60) == 4 * 60


def test_fragment_order_layout():
    x = torch.randn(3, 70)
    xf = fragment_order(x, 8)
    assert xf.shape == (3, 8, 32) and xf.dtype == torch.float16
    for w in range(8):  # word w, k-step s, element i: column 32w + s // 2 + 16 (s % 2) + 4i
        for s in range(8):
            for i in range(4):
                c = 32 * w + s // 2 + 16 * (s % 2) + 4 * i
                expect = x[:, c].half() if c < 70 else torch.zeros(3, dtype=torch.float16)
                assert torch.equal(xf[:, w, 4 * s + i], expect)


def _tile_pos(n: int, col: int) -> int:
    """prefill_wg.cu `tile_pos`, replayed: where column `col` of tile token n lies in a tile."""
    w, c = col >> 5, col & 31
    j = (c >> 2) & 3
    k = 2 * ((w & 7) >> 1) + (j & 1) + 8 * (j >> 1)
    s, hc = 2 * (c & 3) + (c >> 4), 2 * (w >> 3) + (w & 1)
    return hc * 16384 + s * 2048 + (n >> 3) * 128 + (k >> 3) * 64 + (n & 7) * 8 + (k & 7)


def test_wgmma_tiles_put_each_column_where_the_kernel_reads_it():
    x = torch.randn(5, 300)
    rows = torch.randint(0, 5, (256,))
    tiles = wgmma_tiles(x, 16, rows).reshape(2, -1)
    assert tiles.shape == (2, 128 * 16 * 32)
    cols = torch.arange(16 * 32)
    for t, n in itertools.product(range(2), range(0, 128, 7)):
        pos = torch.tensor([_tile_pos(n, int(c)) for c in cols])
        want = F.pad(x[rows[128 * t + n]], (0, 16 * 32 - 300)).half()
        assert torch.equal(tiles[t, pos], want), (t, n)


def _token_tiles_replay(x: torch.Tensor, wpad: int, rows: torch.Tensor) -> torch.Tensor:
    """cuda/prefill_wg.cu `token_tiles`' index math, in torch: unit u of tile t = [hc][s][token
    group][k half][token], 8 k a unit; k -> column by the inverse of `tile_pos`."""
    units = wpad // 4 * 2048
    u = torch.arange(units)
    hc, s, kh = u >> 11, (u >> 8) & 7, (u >> 3) & 1
    n = ((u >> 4) & 15) * 8 + (u & 7)
    k = 8 * kh[:, None] + torch.arange(8)
    j = (k & 1) + 2 * (k >> 3)
    w = 8 * (hc[:, None] >> 1) + 2 * ((k & 7) >> 1) + (hc[:, None] & 1)
    col = 32 * w + (s[:, None] >> 1) + 4 * j + 16 * (s[:, None] & 1)
    xp = F.pad(x.half(), (0, 32 * wpad - x.shape[1]))
    tiles = rows.numel() // 128
    token = rows.view(tiles, 128)[:, n]  # [tiles, units]
    return xp[token[:, :, None], col[None]].reshape(tiles, -1)


def test_token_tiles_kernel_math_matches_wgmma_tiles():
    x = torch.randn(7, 300)
    rows = torch.randint(0, 7, (384,))
    want = wgmma_tiles(x, 16, rows).reshape(3, -1)
    assert torch.equal(_token_tiles_replay(x, 16, rows), want)


def test_tile_plan_gives_each_slot_its_passes():
    lo, hi = torch.tensor([0, 130, 130, 200]), torch.tensor([130, 130, 200, 457])
    token = torch.zeros(457, dtype=torch.int32)
    plan = tile_plan(Pairs(token, torch.ones(457), lo.int(), lo.int(), hi.int()))
    assert plan.tiles == 4 + 4  # bound: 457 pairs / 128, rounded up, + 4 slots
    assert plan.info[:6].tolist() == [[0, 0], [0, 1], [2, 0], [3, 0], [3, 1], [3, 2]]
    assert plan.info[6:, 0].eq(-1).all()  # past the last tile: its CTAs exit
    assert plan.info[6:, 1].eq(6).all()  # dead tiles hold the live count (down_span)
    tiles = plan.pair.view(-1, 128)
    assert tiles[0].tolist() == list(range(128)) and tiles[1, :2].tolist() == [128, 129]
    assert tiles[1, 2:].eq(129).all() and tiles[2, -1] == 199  # past the end: the last pair
    assert tiles[5, 0] == 456 and tiles[6:].ge(0).all() and tiles[6:].lt(457).all()


# Mixtral at 512 tokens (832 units), a tail of more than half a wave (768), Qwen1.5-MoE's shared
# expert at 512 tokens (128), and small waves
SPAN_CASES = [(832, 264, 56), (768, 264, 56), (128, 264, 22), (1, 4, 3), (9, 4, 1), (11, 4, 2)]


@pytest.mark.parametrize("units, sk, chunks", [*SPAN_CASES, (264, 264, 5)])
def test_down_spans_cover_each_chunk_once_and_even_out_the_last_wave(units, sk, chunks):
    spans = layouts.down_spans(units, sk, chunks)
    assert spans[0][0] == 0 and spans[-1][1] == units * chunks
    # contiguous: each chunk once
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    rest = units % sk  # units past the whole waves: shared out if at most half a wave
    whole = units - rest if 2 * rest <= sk else units
    assert all(hi - lo == chunks for lo, hi in spans[:whole])  # one unit a CTA before the wave
    wave = [hi - lo for lo, hi in spans[whole:]]
    assert len(wave) == sk and max(wave) - min(wave) <= 1  # the wave's CTAs: equal shares
    assert max(wave) <= -(-chunks // 2)  # at most half a unit: a share spans at most two jobs


@pytest.mark.parametrize("T", [1, 127, 128, 129, 700])
def test_shared_expert_tiles_are_its_slots_plan(T):
    """The shared expert's cached plan (one slot of every token) is `tile_plan`'s: its live tiles
    and, the bound being exact for one slot, the one dead tile that ends every plan."""
    shared = all_tokens(T, None, 8, torch.device("cpu"))
    want = tile_plan(shared).info
    assert want[-1].tolist() == [-1, -(-T // 128)] and want[:-1, 0].eq(0).all()
    assert torch.equal(layouts.one_slot_tiles(T, torch.device("cpu")), want)


def test_wgmma_order_matches_the_kernels_a_registers():
    """wgmma_order puts, at k-step s = 8u + 2C + h of chunk `it`, position k = 2t + 8jj + lohi,
    the column whose weight lane t holds there: decode_word's register A[2C + h][2jj] is half2
    2h + jj of phase C of plane word 8it + 2t + u (columns C + 8(2h + jj) + {0, 4})."""
    x = torch.randn(2, 700)
    xw = wgmma_order(x, 24)
    assert xw.shape == (2, 24 * 32) and xw.dtype == torch.float16
    seen = set()
    for it in range(3):
        steps = itertools.product(range(2), range(4), range(2), range(4), range(2), range(2))
        for u, C, h, t, jj, lohi in steps:
            col = 32 * (8 * it + 2 * t + u) + C + 8 * (2 * h + jj) + 4 * lohi
            pos = it * 256 + (8 * u + 2 * C + h) * 16 + 2 * t + 8 * jj + lohi
            expect = x[:, col].half() if col < 700 else torch.zeros(2, dtype=torch.float16)
            assert torch.equal(xw[:, pos], expect), (it, u, C, h, t, jj, lohi)
            seen.add(pos)
    assert seen == set(range(24 * 32))  # a permutation


# --- a Python twin of cuda/planes.cuh's label decode (`decode`: gather, lut_from, lut8 / lut16)


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt (default mode, selector bit 3 clear): byte i of the result is byte sel[i] of b:a."""
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def _gather(P: list[int], C: int, top: int, n: int) -> int:
    s = 0
    for q in range(n):
        v, d = P[top - q], C - q
        s |= ((v >> d) if d >= 0 else (v << -d) & 0xFFFFFFFF) & (0x11111111 << q)
    return s


def _table_shift(B: int, row: int) -> int:
    return (row & 1) << 5 if B == 5 else 0


def _decode(
    P: list[int], table: list[int], B: int, C: int, g: int = 0, as_bytes: bool = False
) -> list[int]:
    """decode<B, C, BYTES>: four half2 words (as u32) from plane words P and an fp16 table; for
    B > 4 `table` is the row's shared-memory slot (256 entries) as stage() writes it for a row
    of 8-row group g (`_table_shift`), and `as_bytes` takes the prefill's byte lookup."""
    if B > 4:  # shared-memory table: label = high nibble (planes 0..B-5) : low nibble
        lo, hi = _gather(P, C, B - 1, 4), _gather(P, C, B - 5, B - 4)
        row = table[_table_shift(B, g) :]
        if as_bytes:  # even labels in ev, odd in od: byte j holds labels 2j, 2j + 1
            ev = (lo & 0x0F0F0F0F) | ((hi << 4) & 0xF0F0F0F0)
            od = ((lo >> 4) & 0x0F0F0F0F) | (hi & 0xF0F0F0F0)
            pick = [(_prmt(ev, 0, 0x4440 + j), _prmt(od, 0, 0x4440 + j)) for j in range(4)]
            return [_prmt(row[a], row[b], 0x5410) for a, b in pick]
        v = [row[(lo >> 4 * k) & 15 | ((hi >> 4 * k) & 15) << 4] for k in range(8)]
        return [v[2 * j] | v[2 * j + 1] << 16 for j in range(4)]
    W = [table[2 * i] | table[2 * i + 1] << 16 if 2 * i < len(table) else 0 for i in range(8)]
    L = [_prmt(W[0], W[1], 0x6420), _prmt(W[2], W[3], 0x6420)]
    L += [_prmt(W[0], W[1], 0x7531), _prmt(W[2], W[3], 0x7531)]
    L += [_prmt(W[4], W[5], 0x6420), _prmt(W[6], W[7], 0x6420)]
    L += [_prmt(W[4], W[5], 0x7531), _prmt(W[6], W[7], 0x7531)]

    def interleave(lo: int, hi: int) -> tuple[int, int]:
        return _prmt(lo, hi, 0x5140), _prmt(lo, hi, 0x7362)

    out = []
    if B <= 3:
        s = _gather(P, C, B - 1, B)
        for sel in (s & 0xFFFF, s >> 16):
            out += interleave(_prmt(L[0], L[1], sel), _prmt(L[2], L[3], sel))
    else:
        m = _gather(P, C, 3, 3)
        q = ((P[0] >> (C - 2) if C >= 2 else P[0] << (2 - C)) & 0x44444444) | 0x32103210
        for sel, pick in ((m & 0xFFFF, q & 0xFFFF), (m >> 16, q >> 16)):
            lo = _prmt(_prmt(L[0], L[1], sel), _prmt(L[4], L[5], sel), pick)
            hi = _prmt(_prmt(L[2], L[3], sel), _prmt(L[6], L[7], sel), pick)
            out += interleave(lo, hi)
    return out


@pytest.mark.parametrize("B", range(1, 9))
def test_label_decode_twin_matches_format(B):
    """The kernels' label decode, replayed in Python on random planes: half2 j of phase C holds
    the table entries of columns C + 8j and C + 8j + 4 (the k-steps of fragment order). Widths
    5-8 read a row's table from its shared-memory slot as stage() writes it, for rows of both
    parities, by nibbles (decode kernels) and by bytes (prefill kernels)."""
    gen = torch.Generator().manual_seed(B)
    for g in (0, 1) if B > 4 else (0,):
        labels = torch.randint(0, 1 << B, (1, 32), generator=gen)
        P = [int(w) & 0xFFFFFFFF for w in pack_planes(labels, B)[:, 0, 0]]
        table = [int(v) for v in torch.randint(0, 1 << 16, (1 << B,), generator=gen)]
        staged = table
        if B > 4:  # the row's slot: 256 entries, the table from _table_shift on
            staged = [0] * 256
            staged[_table_shift(B, g) : _table_shift(B, g) + len(table)] = table
        lab = labels[0].tolist()
        for C, as_bytes in itertools.product(range(4), (False, True) if B > 4 else (False,)):
            words = _decode(P, staged, B, C, g, as_bytes)
            for j, w in enumerate(words):
                assert w & 0xFFFF == table[lab[C + 8 * j]], (g, C, as_bytes, j)
                assert w >> 16 == table[lab[C + 8 * j + 4]], (g, C, as_bytes, j)


@pytest.mark.parametrize("B", range(5, 9))
def test_wide_tables_of_one_shared_load_cover_every_bank(B):
    """The 8 rows one shared load meets (rows g = 0..7, slots of 128 words) spread their tables
    over all 32 banks, 5 bits included (16 words a table: table_shift)."""
    banks = {
        (128 * g + (_table_shift(B, g) + e) // 2) % 32 for g in range(8) for e in range(1 << B)
    }
    assert banks == set(range(32))


# --- the one-token kernels' arithmetic (cuda/popc.cu gate_up_p1 / down_p1; pwctl/kernels/popc.py)


@pytest.mark.parametrize("B", range(1, 5))
def test_subset_coefficients_rebuild_every_table_entry(B):
    gen = torch.Generator().manual_seed(B)
    table = torch.randn(5, 1 << B, generator=gen).half()
    c = subset_coefficients(table, B)
    for label in range(1 << B):
        planes = sum(1 << p for p in range(B) if label >> (B - 1 - p) & 1)  # plane p: bit B-1-p
        total = sum(c[:, S] for S in range(1 << B) if S & planes == S)
        torch.testing.assert_close(total, table[:, label].double(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("words", [4, 8, 12, 16, 24, 44, 64, 176, 448])
def test_step_words_cover_each_word_once(words):
    steps = step_words(words)
    flat = [w for ws in steps for w in ws]
    assert sorted(flat) == list(range(words))
    assert len(steps) == popc.steps(words)
    assert all(len(ws) <= 8 for ws in steps)


def test_quantize_spans_sixteen_bits_and_keeps_zero():
    x = torch.tensor([0.5, -2.0, 1e-4, 0.0])
    q, sx = quantize(x)
    assert int(q.abs().max()) == 32767 and int(q[3]) == 0
    assert (q.float() * sx - x).abs().max() <= sx / 2 + 1e-9
    assert quantize(torch.zeros(3))[0].abs().sum() == 0


@pytest.mark.parametrize("B", range(1, 5))
@pytest.mark.parametrize("cols", [128, 1408, 9216])  # 1 piece with a partial k-step; 2 pieces
def test_popc_twin_matches_lookup(B, cols):
    """The kernels' arithmetic (subset coefficients, 16-bit x per piece, exact integer dot
    products) against the table lookup in fp64, with outlier channels in x."""
    gen = torch.Generator().manual_seed(B * cols)
    rows = 24
    table = torch.sort(torch.randn(rows, 1 << B, generator=gen) * 0.02, 1).values.half()
    labels = torch.randint(0, 1 << B, (rows, cols), generator=gen)
    x = torch.randn(cols, generator=gen)
    x[torch.randperm(cols, generator=gen)[:8]] *= 50
    x = x.half()
    want = table.double().gather(1, labels) @ x.double()
    got = popc_matvec(labels, table, B, x)
    assert float((got - want).norm() / want.norm()) < 1e-3
    # the k-split of down: slices of k-steps (starting on a full chunk) add up to the whole
    n = len(step_words(-(-cols // 32)))
    mid = n // 4 * 2
    halves = sum(popc_matvec(labels, table, B, x, k) for k in ((0, mid), (mid, n)))
    assert float((halves - want).norm() / want.norm()) < 1e-3


@pytest.mark.parametrize("shared", [False, True])
def test_decode_launches_pick_the_one_token_kernels(monkeypatch, shared):
    """The launcher's choice, on the CPU with launches recorded: one token with popc_decode set
    gives x's pieces to the prep launch (8 more blocks a piece) and takes gate_up_p1,
    popc_planes (h of both groups: a warp a k-step of the longest piece), down_p1, or their
    3-bit builds when no block of the layer is wider than 3 bits; calls of up to POPC_MAX_TOKENS
    tokens take gate_up_pn / down_pn (pnb3); one token with a block wider than 4 bits, the 5-bit
    build (p1b5); more tokens, the flag off, or no block of the layer the build's binary mma
    reads (4 bits, one token 5), no pieces and the lookup kernels. By default (popc_decode
    None) the rule of docs/decisions/034-wide-block-rule.md: one token on the popc kernels from
    P1_MIN_WEIGHTS a token (the lookup kernels below), with blocks past 4 bits by the shares of
    the layer's weights and of its gate and up weights past 4 and 5 bits: p1, p1b5 (large layers)
    or the lookup gate_up with the popc down; a few tokens on large layers only, while under half
    the weights are past 4 bits."""
    launched = []
    record = lambda name, grid, block, *args, **kw: launched.append((name, grid, block))  # noqa: E731
    monkeypatch.setattr(launch, "launch_packed", record)
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)  # the H200's (no device here)
    monkeypatch.setattr(launch, "ctas_per_sm", lambda name, threads: 4)
    spec = MoESpec(4, 2, 4096, 768, "softmax_topk", False, 1.0, 256 if shared else 0, True, "silu")
    layer = synthetic_layer(spec, device="cpu", seed=0)
    moe = layer.moe
    gu, dn = moe.proj[(0, False, "gate")], moe.proj[(0, False, "down")]

    def use(**changes) -> None:  # the rules with these changes
        moe.rules = replace(moe.rules, **changes)

    def decode(T: int, popc_on: bool | None) -> list[tuple[str, tuple, tuple]]:
        launched.clear()
        use(popc_decode=popc_on)
        x, weights, index, scale = random_routing(spec, T, device="cpu", seed=T)
        px = moe._x_pieces(0, T, x.device)
        out = torch.zeros_like(x)
        prepare_decode(x, index, weights, spec.num_experts, gu.wpad, out, pieces=px)
        pairs = group(index, weights, spec.num_experts)
        one = group(index[:, :1] * 0, weights[:, :1], 1) if shared else None
        moe._decode(0, fragment_order(x, gu.wpad), pairs, out, one, px)
        return list(launched)

    plain = decode(1, False)
    names = [n for n, _, _ in plain]
    assert names == ["decode_prep", "gate_up_n1", "down_n1"]
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    one = decode(1, True)
    assert [n for n, _, _ in one] == ["decode_prep", "gate_up_p1", "popc_planes", "down_p1"]
    widths = np.full(layer.table.n_blocks, 3)  # no block wider than 3 bits: the 5-CTA build
    widths[moe._layer_blocks[0][-1]] = 2
    layer.set_widths(widths)
    names = [n for n, _, _ in decode(1, True)]
    assert names == ["decode_prep", "gate_up_p1b3", "popc_planes", "down_p1b3"]
    names = [n for n, _, _ in decode(2, True)]
    assert names == ["decode_prep", "gate_up_pnb3", "popc_planes", "down_pnb3"]
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    x_blocks = popc.pieces(gu.words) * geometry.POPC_SPLIT  # 768 columns: one piece
    assert one[0][1] == (plain[0][1][0] + x_blocks,)
    rows_h = spec.top_k + (1 if shared else 0)  # routed pairs, then the shared expert's
    steps = max(popc.steps(moe.proj[(0, g, "down")].words) for g in {False, shared})
    assert one[2][1:] == ((popc.pieces(dn.words), rows_h, geometry.POPC_SPLIT), (32 * steps,))
    # up to POPC_MAX_TOKENS tokens the same kernels (their slots of several tokens take the
    # lookup inside them), with every token's x pieces; past it the lookup kernels
    two = decode(2, True)
    assert [n for n, _, _ in two] == ["decode_prep", "gate_up_pn", "popc_planes", "down_pn"]
    assert two[0][1] == (decode(2, False)[0][1][0] + 2 * x_blocks,)
    assert two[2][1][1] == 2 * rows_h
    past = geometry.POPC_MAX_TOKENS + 1
    names = [n for n, _, _ in decode(past, True)]
    n = f"n{geometry.n_tiles(past)}"
    assert names == ["decode_prep", f"gate_up_{n}", f"down_{n}"]
    # no block of the layer the binary mma reads (all wider than 4 bits): the lookup kernels
    widths[:] = 5
    widths[moe._layer_blocks[0][0]] = 4
    layer.set_widths(widths)
    assert [n for n, _, _ in decode(2, True)][1] == "gate_up_pn"
    # one token with a block wider than 4 bits: the 5-bit build, while any block is 5 bits or
    # less (blocks past 5 take its lookup); every block wider: the lookup kernels
    names = [n for n, _, _ in decode(1, True)]
    assert names == ["decode_prep", "gate_up_p1b5", "popc_planes", "down_p1b5"]
    layer.set_widths(np.full(layer.table.n_blocks, 5))
    names = [n for n, _, _ in decode(1, True)]
    assert names == ["decode_prep", "gate_up_p1b5", "popc_planes", "down_p1b5"]
    use(popc_b5=False)  # off: 5 bits past the 4-bit build
    names = [n for n, _, _ in decode(1, True)]
    assert names == ["decode_prep", "gate_up_n1", "down_n1"]
    use(popc_b5=True)
    layer.set_widths(np.full(layer.table.n_blocks, 6))
    names = [n for n, _, _ in decode(1, True)]
    assert names == ["decode_prep", "gate_up_n1", "down_n1"]
    # by default (popc_decode None) one token takes the popc kernels only on a layer of
    # P1_MIN_WEIGHTS: under it, the lookup kernels at every width
    blocks, n = moe._layer_blocks[0], layer.table.n_blocks
    layer.set_widths(np.full(n, 4))
    use(popc_min_weights=moe._reads[0] + 1)
    use(p1_min_weights=moe._reads[0] + 1)
    assert [n for n, _, _ in decode(1, None)][1:] == ["gate_up_n1", "down_n1"]
    widths[:] = 4
    widths[blocks[0]] = 5
    layer.set_widths(widths)
    assert [n for n, _, _ in decode(1, None)][1:] == ["gate_up_n1", "down_n1"]
    # on a layer of P1_MIN_WEIGHTS: p1 while under MID_P1_UNTIL_WIDE of its weights are past 4
    # bits, the split build from there on
    use(p1_min_weights=0)
    p1 = ["gate_up_p1", "popc_planes", "down_p1"]
    split = ["gate_up_n1", "popc_planes", "down_p1"]  # the lookup gate_up, the popc down
    p1b5 = ["gate_up_p1b5", "popc_planes", "down_p1b5"]
    span = moe._widths(0)
    assert span.gate_up_wide > span.wide > 0 == span.gate_up_wider  # expert 0's gate alone
    use(mid_p1_until_wide=span.wide + 0.01)
    assert [n for n, _, _ in decode(1, None)][1:] == p1
    use(mid_p1_until_wide=span.wide)
    assert [n for n, _, _ in decode(1, None)][1:] == split
    # on a large layer (`_popc_pays`): p1b5 from P1B5_FROM_WIDE of its weights past 4 bits
    # while under P1B5_UNTIL_WIDER are past 5; else p1 while under P1_UNTIL_GATE_UP_WIDE of its
    # gate and up weights are past 4 bits and under P1_UNTIL_GATE_UP_WIDER past 5
    use(popc_min_weights=0)
    assert moe._widths(0).wide < moe.rules.p1b5_from_wide
    assert moe._widths(0).gate_up_wide < moe.rules.p1_until_gate_up_wide
    assert [n for n, _, _ in decode(1, None)][1:] == p1
    downs = np.full(n, 4)
    downs[blocks[2::3]] = 8  # every down past 5 bits, the shared expert's too: still p1
    layer.set_widths(downs)
    span = moe._widths(0)
    assert span.gate_up_wide == 0 < moe.rules.p1_until_gate_up_wider < span.wider
    assert [n for n, _, _ in decode(1, None)][1:] == p1
    layer.set_widths(widths)
    widths[blocks[:3]] = 5  # expert 0's gate, up and down
    layer.set_widths(widths)

    def weights(shared: bool, projs: tuple[str, ...]) -> int:
        return sum(
            q.rows * q.cols for (_, s, p), q in moe.proj.items() if s == shared and p in projs
        )

    def expert_0(projs: tuple[str, ...]) -> float:  # its blocks' share of the layer's
        return weights(False, projs) / (
            spec.num_experts * weights(False, projs) + weights(True, projs)
        )

    everything, gate_up = expert_0(("gate", "up", "down")), expert_0(("gate", "up"))
    want = (4, 5, pytest.approx(everything), 0.0, pytest.approx(gate_up), 0.0)
    assert moe._widths(0) == want
    use(p1b5_from_wide=moe._widths(0).wide)
    assert [n for n, _, _ in decode(1, None)][1:] == p1b5
    assert [n for n, _, _ in decode(2, None)][1] == "gate_up_pn"
    use(popc_b5=False)  # off: p1
    assert [n for n, _, _ in decode(1, None)][1:] == p1
    use(p1_until_gate_up_wide=moe._widths(0).gate_up_wide)
    assert [n for n, _, _ in decode(1, None)][1:] == split
    use(p1_until_gate_up_wide=0.5)
    use(popc_b5=True)
    widths[blocks[1]] = 6
    layer.set_widths(widths)
    wider = moe._widths(0).wider
    assert 0 < wider < moe._widths(0).wide
    use(p1b5_until_wider=wider + 0.01)
    assert [n for n, _, _ in decode(1, None)][1:] == p1b5  # p1b5 reads the 6-bit one's lookup
    use(p1b5_until_wider=wider)
    assert [n for n, _, _ in decode(1, None)][1:] == p1
    use(p1_until_gate_up_wider=moe._widths(0).gate_up_wider)
    # past P1_UNTIL_GATE_UP_WIDER the split build: the lookup gate_up, the popc down (POPC_DOWN)
    split_launches = decode(1, None)
    assert [n for n, _, _ in split_launches][1:] == split
    assert [n for n, _, _ in decode(2, None)][1] == "gate_up_pn"
    use(popc_down=False)
    lookup = decode(1, None)
    assert [n for n, _, _ in lookup][1:] == ["gate_up_n1", "down_n1"]
    use(popc_down=True)
    use(popc_b5=False)
    p1_launches = decode(1, True)  # p1: the launches the split one takes after its gate_up
    use(popc_b5=True)
    assert split_launches[0][1] == lookup[0][1]  # the prep builds no x pieces for the lookup
    assert split_launches[1] == lookup[1] and split_launches[2:] == p1_launches[2:]  # grids
    # no block the popc down's mma reads: the split build still (its lookup of wide blocks)
    layer.set_widths(np.full(layer.table.n_blocks, 6))
    assert [n for n, _, _ in decode(1, None)][1:] == split
    layer.set_widths(widths)
    # a few tokens: the popc kernels until PN_UNTIL_WIDE of the weights are in blocks past 4
    # bits, the lookup kernels from there on (popc_decode True keeps the popc kernels)
    seen = set()
    for b in blocks[3:-1]:
        widths[b] = 8
        layer.set_widths(widths)
        pn = moe._widths(0).wide < moe.rules.pn_until_wide
        seen.add(pn)
        assert [n for n, _, _ in decode(2, None)][1] == ("gate_up_pn" if pn else "gate_up_n1")
        assert [n for n, _, _ in decode(2, True)][1] == "gate_up_pn"
    assert seen == {True, False}
    use(popc_min_weights=moe._reads[0] + 1)
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    assert [n for n, _, _ in decode(1, None)][1:] == ["gate_up_p1", "popc_planes", "down_p1"]
    assert [n for n, _, _ in decode(2, None)][1] == "gate_up_n1"


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_torch_path_matches_expert_store(packs, arch):
    """Planes paged by the pager (mixed widths) and read back through the DeviceTable give the
    same layer output as the ExpertStore reference at the same widths."""
    pack = Pack(packs[(arch, "per_expert")])
    m = pack.manifest
    spec = MoESpec(**m.spec)
    full = sum(b.bytes_at(m.max_bits) for b in pack.blocks)
    table = PageTable.from_pack(pack, budget_bytes=2 * full)
    backend = CpuBackend.from_pack(pack, table)
    pager = Pager(table, backend)
    rng = np.random.default_rng(0)
    pager.request(rng.integers(m.min_bits, m.max_bits + 1, table.n_blocks))
    pager.settle()
    dt = DeviceTable(table, torch.from_numpy(backend.arena), pack.blocks)
    moe = FusedMoE(spec, dt, pack.index)
    store = ExpertStore(pack)
    store.plan.set(table.width)
    gen = torch.Generator().manual_seed(1)
    layer = m.moe_layers[0]
    x = torch.randn(7, spec.hidden, generator=gen)
    weights, index = route(torch.randn(7, spec.num_experts, generator=gen), spec)
    scale = torch.sigmoid(torch.randn(7, 1, generator=gen)) if spec.shared_gate else None
    got = moe(layer, x, weights, index, scale)
    want = torch.zeros_like(x)
    for t in range(7):
        for s in range(spec.top_k):
            e = int(index[t, s])
            want[t] += weights[t, s] * store.mlp(layer, e, x[t : t + 1])[0]
        if spec.has_shared:
            shared = store.mlp(layer, spec.num_experts, x[t : t + 1])[0]
            want[t] += shared * (scale[t] if scale is not None else 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_synthetic_layer_reads_back_through_shuffled_slabs():
    spec = MoESpec(4, 2, 64, 96, "softmax_topk", False, 1.0, 32, True, "silu")
    layer = synthetic_layer(spec, device="cpu", seed=3)
    for b in range(layer.table.n_blocks):
        w8, w3 = layer.dt.weight(b, 8), layer.dt.weight(b, 3)
        assert torch.isfinite(w8).all() and w8.shape == (layer.blocks[b].rows, layer.blocks[b].cols)
        assert len(torch.unique(w3[0])) <= 8 < len(torch.unique(w8[0]))


# --- CUDA kernels (skipped without CUDA; run on the H200 before the kernel issue closes) --------


def _set_widths(layer, width: str, rng: np.random.Generator) -> None:
    """Every block of the synthetic layer at `width` bits, or ("mixed") each at a random width."""
    t = layer.table
    w = rng.integers(t.min_bits, t.max_bits + 1, t.n_blocks) if width == "mixed" else int(width)
    layer.set_widths(np.broadcast_to(w, (t.n_blocks,)))


def _poison(moe: FusedMoE) -> None:
    junk = torch.full((64 << 20,), float("nan"), device="cuda")  # freed: fresh buffers see NaN
    del junk
    for hp in moe._hp.values():
        hp.fill_(float("nan"))


PREFILL_KINDS = ["wgmma", "mma"] if torch.cuda.is_available() and build.has_wgmma() else ["mma"]


# rows and columns off every tile size: partial m-tiles, a down CTA whose second m-tile is past
# the last row, odd plane words, a shared expert
ODD = MoESpec(6, 2, 120, 200, "softmax_topk", False, 1.0, 72, True, "silu")
# rows of 6 and 10 plane words: 8-byte but not 16-byte aligned, so the sm_90a prefill takes its
# word-by-word loop (no plane ring)
WORDS_2_MOD_4 = MoESpec(4, 2, 192, 320, "softmax_topk", False, 1.0, 0, False, "silu")
# gate rows of 140 plane words (560 bytes): in 16 KB slabs a 16-row tile's rows straddle edges
STRADDLE = MoESpec(4, 2, 4480, 1024, "softmax_topk", False, 1.0, 0, False, "silu")
TEST_SPECS = {"odd": ODD, "words-2-mod-4": WORDS_2_MOD_4}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [*SHAPES, *TEST_SPECS])
def test_kernels_match_reference(shape):
    layer = synthetic_layer(SHAPES.get(shape) or TEST_SPECS[shape], seed=1)
    rng = np.random.default_rng(1)
    worst = {}
    for width in ["2", "3", "4", "5", "6", "7", "8", "mixed"]:
        _set_widths(layer, width, rng)
        # decode tiles of 1, 2, 4 and 8 n-tiles (up to 64 tokens), then prefill
        for T in (1, 2, 3, 8, 9, 20, 40, 512 if width in ("3", "mixed") else 65):
            x, weights, index, scale = random_routing(layer.spec, T, seed=T)
            want = layer.moe(0, x, weights, index, scale, reference=True)
            # prefill: the sm_90a (wgmma) kernels where the device has them, and the mma.sync ones
            for kind in PREFILL_KINDS if T > geometry.DECODE_MAX_TOKENS else ["decode"]:
                layer.moe.prefill_kernel = kind
                _poison(layer.moe)
                got = layer.moe(0, x, weights, index, scale)
                torch.cuda.synchronize()
                err = float((got - want).norm() / want.norm())
                worst[(width, T, kind)] = err
                case = f"{shape} width {width} tokens {T} {kind}"
                assert err < 1e-3, f"{case}: relative error {err:.2e}"
    print(shape, "max relative error", max(worst.values()))


# the kernels' variants (issues 64 and 65; their CPU twins: tests/test_kernel_variants.py)
VARIANT_SHAPES = ["gpt-oss-20b", "gemma4-26b-a4b"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", VARIANT_SHAPES)
def test_variant_kernels_match_reference(shape):
    """The clamped SwiGLU with biases (GPT-OSS) and GELU-tanh (Gemma-4) layers, on every decode
    build and both prefills, against the torch path with the same biases: decode at 1, 4 and
    16 tokens, prefill at 512, at 2, 4 and 8 bits and mixed widths 2-8."""
    from pwctl.bench.kernels import random_routing

    layer = synthetic_layer(SHAPES[shape], seed=7)
    rng = np.random.default_rng(7)
    for width in ["2", "4", "8", "mixed"]:
        _set_widths(layer, width, rng)
        for T in (1, 4, 16, 512):
            x, weights, index, scale = random_routing(layer.spec, T, seed=T)
            want = layer.moe(0, x, weights, index, scale, reference=True, bias=layer.bias)
            for kind in PREFILL_KINDS if T > geometry.DECODE_MAX_TOKENS else ["decode"]:
                layer.moe.prefill_kernel = kind
                for forced in (None, False) if kind == "decode" else (None,):
                    layer.moe.rules = replace(layer.moe.rules, popc_decode=forced)
                    _poison(layer.moe)
                    got = layer.moe(0, x, weights, index, scale, bias=layer.bias)
                    torch.cuda.synchronize()
                    err = float((got - want).norm() / want.norm())
                    case = f"{shape} width {width} tokens {T} {kind} popc {forced}"
                    assert err < 1e-3, f"{case}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16])
def test_route_prep_with_router_bias_and_top_k_then_softmax(T):
    """GPT-OSS's router in the decode's first launch: logits = x W^T + b within fp16 rounding of
    torch's biased linear, the top-k of the logits, then softmax over those k (`route`)."""
    E, H = 32, 2880
    spec = MoESpec(E, 4, 64, H, "topk_softmax", False, 1.0, 0, False, CLAMPED_SWIGLU, True, True)
    gen = torch.Generator(device="cuda").manual_seed(T)
    gw = (torch.randn(E, H, generator=gen, device="cuda") * 0.05).half()
    rb = (torch.randn(E, generator=gen, device="cuda") * 0.5).half()
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    wpad = -(-H // 256) * 8
    for _ in range(2):  # the completion counter is back at zero for the second launch
        x = torch.randn(T, H, generator=gen, device="cuda").half()
        out = torch.full((T, H), float("nan"), device="cuda")
        pairs, xf, got = prepare_routed(x, gw, None, spec, wpad, out, done, router_bias=rb)
        torch.testing.assert_close(got.logits, F.linear(x, gw, rb).float(), rtol=2e-3, atol=2e-3)
        want_w, want_i = route(got.logits.half(), spec)
        torch.testing.assert_close(got.logits.gather(1, got.index), got.logits.gather(1, want_i))
        torch.testing.assert_close(got.weights, want_w, rtol=1e-5, atol=1e-6)
        want = group(got.index, got.weights, E)
        for field in ("token", "weight", "lo", "hi"):
            assert torch.equal(getattr(pairs, field), getattr(want, field)), field
        assert torch.equal(xf, fragment_order(x, wpad)) and not out.any()
        assert int(done) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_routed_gpt_oss_layer_matches_reference(T):
    """`FusedMoE.routed` on the GPT-OSS shape, router bias and expert biases included, against
    the torch path on the routing it chose, eager and replayed from a CUDA graph."""
    layer = synthetic_layer(SHAPES["gpt-oss-20b"], seed=3)
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    spec, gen = layer.spec, torch.Generator(device="cuda").manual_seed(0)
    from pwctl.bench import kernels as kb

    gw, _, rb = kb.router_weights(spec, 0)
    x = torch.randn(T, spec.hidden, generator=gen, device="cuda").half()

    def check(out: torch.Tensor, case: str) -> None:
        r = layer.moe._routing[(T, False)]
        torch.testing.assert_close(r.logits, F.linear(x, gw, rb).float(), rtol=2e-3, atol=2e-3)
        want = layer.moe(0, x, r.weights, r.index, None, reference=True, bias=layer.bias)
        err = float((out - want).norm() / want.norm())
        assert err < 1e-3 and math.isfinite(err), f"T {T} {case}: relative error {err:.2e}"

    check(layer.moe.routed(0, x, gw, None, rb, layer.bias)[0].clone(), "eager")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.moe.routed(0, x, gw, None, rb, layer.bias)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out, _ = layer.moe.routed(0, x, gw, None, rb, layer.bias)
    x.copy_(torch.randn(T, spec.hidden, generator=gen, device="cuda").half())
    graph.replay()
    torch.cuda.synchronize()
    check(out.clone(), "replay")


@pytest.mark.gpu
@pytest.mark.skipif(PREFILL_KINDS[0] != "wgmma", reason="the sm_90a prefill needs Hopper")
@pytest.mark.parametrize("shape", ["qwen-moe", "qwen3-moe", *TEST_SPECS])
def test_prefill_down_on_its_stream_k_wave_matches_reference(shape):
    """down's stream-K wave (cuda/prefill_wg.cu down_span) on shapes the launcher's rule leaves off:
    shares that begin inside units (odd first chunks: an empty mbarrier phase first), fewer
    units than the wave and more; ring (3 bits) and register (6 bits) loops, the mixed layer.
    Qwen1.5-MoE's shared expert at 65 tokens (32 units of 22 chunks, shares of 2-3) has CTAs
    that run two jobs (the routed layers' draws may not)."""
    layer = synthetic_layer(SHAPES.get(shape) or TEST_SPECS[shape], seed=5)
    rng = np.random.default_rng(5)
    layer.moe.prefill_kernel = "wgmma"
    layer.moe.rules = replace(layer.moe.rules, down_stream_k=True)
    for width in ["3", "6", "mixed"]:
        _set_widths(layer, width, rng)
        for T in (65, 700):
            x, weights, index, scale = random_routing(layer.spec, T, seed=T)
            want = layer.moe(0, x, weights, index, scale, reference=True)
            _poison(layer.moe)
            got = layer.moe(0, x, weights, index, scale)
            torch.cuda.synchronize()
            err = float((got - want).norm() / want.norm())
            assert err < 1e-3, f"{shape} width {width} tokens {T}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_token_kernels_match_reference_and_lookup(shape):
    """One-token calls on the binary tensor-core kernels (gate_up_p1 / down_p1, the p1b3
    builds the launcher takes up to 3 bits and the p1b5 ones past 4) and on the lookup ones,
    every real shape: against the reference at every width, mixed widths, and with outlier
    channels in x (x is 16-bit fixed point there). Each build also runs on layers of other
    widths (a graph captured before the pager moved them): p1b3 and p1 on wider blocks, which
    their lookup path reads, p1b5 on narrower ones and on 8 bits. The split build (the lookup
    gate_up, the popc down: "n1p1") on every width."""
    layer = synthetic_layer(SHAPES[shape], seed=3)
    t = layer.table
    rng = np.random.default_rng(3)
    forced = {"3": ["p1b5"], "4": ["p1b3", "p1b5"], "5": ["p1"], "8": ["p1b5"]}
    forced["mixed"] = ["p1b3", "p1", "p1b5"]
    for width in ["1", "2", "3", "4", "5", "8", "mixed"]:
        w = rng.integers(t.min_bits, t.max_bits + 1, t.n_blocks) if width == "mixed" else int(width)
        if width != "mixed" and not t.min_bits <= w <= t.max_bits:
            continue
        layer.set_widths(np.broadcast_to(w, (t.n_blocks,)))
        for outlier in (1.0, 100.0):
            x, weights, index, scale = random_routing(layer.spec, 1, seed=int(outlier))
            x[0, :: max(1, x.shape[1] // 8)] *= outlier
            want = layer.moe(0, x, weights, index, scale, reference=True)
            got = {}
            for on in (True, False):
                layer.moe.rules = replace(layer.moe.rules, popc_decode=on)
                _poison(layer.moe)
                got[on] = layer.moe(0, x, weights, index, scale)
            for kind in forced.get(width, []):  # a build on widths it was not chosen for
                layer.moe.rules = replace(layer.moe.rules, popc_decode=True)
                layer.moe._popc_kind = lambda layer_, T, kind=kind: kind
                _poison(layer.moe)
                got[kind] = layer.moe(0, x, weights, index, scale)
                del layer.moe._popc_kind
            layer.moe._kind = lambda layer_, T, px: "n1p1"  # the lookup gate_up, the popc down
            _poison(layer.moe)
            got["n1p1"] = layer.moe(0, x, weights, index, scale)
            del layer.moe._kind
            torch.cuda.synchronize()
            for on, y in got.items():
                err = float((y - want).norm() / want.norm())
                case = f"{shape} width {width} outlier {outlier} popc {on}"
                assert err < 1e-3, f"{case}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_popc_kernels_take_calls_of_a_few_tokens(shape):
    """Calls of 2..POPC_MAX_TOKENS tokens on the popc kernels: slots of one token on the binary
    mma, the others (and a shared expert's slot of every token) on the lookup inside the same
    launch, against the reference at 3 and 4 bits and mixed widths (pnb3 at 3 bits). The last
    calls route tokens in pairs, so that slots of exactly two tokens are certain."""
    layer = synthetic_layer(SHAPES[shape], seed=4)
    rng = np.random.default_rng(4)
    layer.moe.rules = replace(layer.moe.rules, popc_decode=True)
    calls = [(T, False) for T in range(2, geometry.POPC_MAX_TOKENS + 1)] + [(2, True), (4, True)]
    for width in ["3", "4", "mixed"]:
        _set_widths(layer, width, rng)
        for T, paired in calls:
            x, weights, index, scale = random_routing(layer.spec, T, seed=T)
            if paired:  # token 2i + 1 goes where token 2i goes, with its own x
                index[1::2], weights[1::2] = index[0::2], weights[0::2]
            want = layer.moe(0, x, weights, index, scale, reference=True)
            _poison(layer.moe)
            got = layer.moe(0, x, weights, index, scale)
            torch.cuda.synchronize()
            counts = torch.bincount(index.flatten())
            singles, pairs = int((counts == 1).sum()), int((counts == 2).sum())
            err = float((got - want).norm() / want.norm())
            case = f"{shape} width {width}, {T} tokens ({singles} + {pairs} slots of 1 + 2)"
            assert err < 1e-3, f"{case}: relative error {err:.2e}"
            assert pairs > 0 or not paired, case


# slot sizes a routing column spreads a call's tokens over (beside expert 0, which takes every
# token): with expert 0 they hold 1..NT n-tiles of the call's 2-, 4- and 8-tile launch
TIER_SLOTS = {16: [3, 13], 32: [1, 9, 22], 64: [1, 10, 20, 33]}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_lookup_kernels_take_each_slot_on_its_smallest_tile(shape):
    """The 2-, 4- and 8-tile lookup kernels run each slot on the loop of the smallest tile that
    holds its tokens (cuda/lookup.cu mma_tier): calls whose slots hold every n-tile count from one
    to the launch's, at 3 and 4 bits and mixed widths (5-8 bits: the tables in shared memory)."""
    layer = synthetic_layer(SHAPES[shape], seed=6)
    k = layer.spec.top_k
    rng = np.random.default_rng(6)
    for width in ["3", "4", "mixed"]:
        _set_widths(layer, width, rng)
        for T, sizes in TIER_SLOTS.items():
            x, weights, index, scale = random_routing(layer.spec, T, seed=T)
            # column 0: expert 0; column j: experts 1 + len(sizes) (j - 1) on, `sizes` tokens each
            slot = np.repeat(np.arange(len(sizes)), sizes)
            cols = [np.zeros(T, int)] + [1 + len(sizes) * (j - 1) + slot for j in range(1, k)]
            index = torch.as_tensor(np.stack(cols, 1), dtype=index.dtype, device=index.device)
            want = layer.moe(0, x, weights, index, scale, reference=True)
            _poison(layer.moe)
            got = layer.moe(0, x, weights, index, scale)
            torch.cuda.synchronize()
            tiles = sorted({(int(c) + 7) // 8 for c in torch.bincount(index.flatten()) if c})
            case = f"{shape} width {width}, {T} tokens, slots of {tiles} n-tiles"
            loops = {1 << (n - 1).bit_length() for n in tiles}  # the tile each slot runs on
            assert loops == {n for n in (1, 2, 4, 8) if n <= geometry.n_tiles(T)}, case
            err = float((got - want).norm() / want.norm())
            assert err < 1e-3, f"{case}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["mixtral", "qwen3-moe", "qwen-moe", "straddle"])
def test_one_token_runs_match_reference(shape):
    """gate_up's persistent grid (cuda/lookup.cu Run): each CTA a share of the tiles' halves, the
    tiles after its first restaged by moving the pointers on (`restage`), shares that end
    mid-tile meeting through a ticket (split_join). One CTA a tile, a few CTAs (long runs), the
    launcher's choice and a CTA a half tile, at 3 and 4 bits (p1b3, p1) and mixed widths (wider
    blocks on the lookup, staged afresh; the counts set by hand run the wave in equal shares,
    the launcher's choice one CTA a tile), each call twice: the second half of a tile resets its
    ticket for the next. "qwen-moe": the shared expert's tiles on CTAs of their own after the
    routed ones' (at 4 bits its layer's tiles are more than a wave). "straddle": 560-byte rows in
    16 KB slabs, so that some rows of a tile move on within their slab and others cross an edge
    or straddle one."""
    spec, slab = (STRADDLE, 16384) if shape == "straddle" else (SHAPES[shape], None)
    layer = synthetic_layer(spec, seed=5, slab_bytes=slab)
    moe = layer.moe
    moe.rules = replace(moe.rules, popc_decode=True)
    tiles = 32 * moe.proj[(0, False, "down")].wpad // geometry.ROWS * layer.spec.top_k
    rng = np.random.default_rng(5)
    for width in ["3", "4", "mixed"]:
        _set_widths(layer, width, rng)
        x, weights, index, scale = random_routing(layer.spec, 1, seed=5)
        want = layer.moe(0, x, weights, index, scale, reference=True)
        for runs in (0, 3, None, 2 * tiles):
            moe.rules = replace(moe.rules, gate_up_runs=runs)
            for call in range(2):
                _poison(moe)
                got = moe(0, x, weights, index, scale)
                torch.cuda.synchronize()
                err = float((got - want).norm() / want.norm())
                case = f"{shape} width {width} runs {runs} call {call}"
                assert err < 1e-3, f"{case}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen3-moe", "odd"])
def test_decode_graph_replay_matches_reference(shape):
    """A decode call captured in a CUDA graph (programmatic dependent launch on Hopper) and
    replayed on new inputs copied into its static buffers."""
    layer = synthetic_layer(SHAPES.get(shape, ODD), seed=2)
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    static = random_routing(layer.spec, 4, seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.moe(0, *static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer.moe(0, *static)
    for seed in (1, 2):
        fresh = random_routing(layer.spec, 4, seed=seed)
        for dst, src in zip(static, fresh, strict=True):
            if dst is not None:
                dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = layer.moe(0, *fresh, reference=True)
        err = float((out - want).norm() / want.norm())
        assert err < 1e-3, f"{shape} replay {seed}: relative error {err:.2e}"


# up to 32 pairs one warp sorts them (group_few): 2, 12, 32 of them (16 x 2 on 8 experts: many
# a slot); past 32, group_pairs
DECODE_PREP_CASES = [(1, 2, 8), (3, 4, 60), (4, 8, 128), (16, 2, 8), (8, 8, 128), (64, 8, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("T, k, E", DECODE_PREP_CASES)
def test_decode_prep_matches_torch(T, k, E):
    """One launch: `group`'s pairs, x in fragment order, and the output zeroed (poisoned first)."""

    spec = MoESpec(E, k, 64, 64, "softmax_topk", False, 1.0, 0, False, "silu")
    gen = torch.Generator(device="cuda").manual_seed(T)
    weights, index = route(torch.randn(T, E, generator=gen, device="cuda"), spec)
    x = torch.randn(T, 200, generator=gen, device="cuda").half()  # 200 columns: padded to 256
    out = torch.full((T, 200), float("nan"), device="cuda")
    want, (got, xf) = group(index, weights, E), prepare_decode(x, index, weights, E, 8, out)
    for field in ("token", "weight", "lo", "hi"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    live = want.hi > want.lo  # empty slots may name any expert
    assert torch.equal(got.expert[live], want.expert[live])
    assert torch.equal(xf, fragment_order(x, 8))
    assert torch.equal(out, torch.zeros_like(out))


def read_pieces(buf: torch.Tensor, words: int, row: int) -> tuple[np.ndarray, list, list]:
    """Row `row`'s PopcX pieces (cuda/pieces.cuh) back to q a column, each k-step's ksum and each
    piece's scale: plane k of word z of k-step i is bit c (column c of the word) of register
    2 (z % 2) + k / 8 of lane 4 (k % 8) + z / 2; plane 15 weighs -2^15."""
    n, size, head = popc.pieces(words), geometry.PIECE_BYTES, geometry.POPC_STEPS * 32 * 16
    raw = buf.cpu().numpy().view(np.uint8)[row * n * size : (row + 1) * n * size]
    q, ksums, scales = np.zeros(32 * words, np.int64), [], []
    weight = np.array([1 << k for k in range(15)] + [-(1 << 15)], np.int64)
    for i, ws in enumerate(popc.step_words(words)):
        pc, j = divmod(i, geometry.POPC_STEPS)
        rec = raw[pc * size : (pc + 1) * size]
        a = rec[:head].view(np.uint32).reshape(geometry.POPC_STEPS, 32, 4)
        for z, w in enumerate(ws):
            for k in range(16):
                u = int(a[j, 4 * (k % 8) + z // 2, 2 * (z % 2) + k // 8])
                bits = (u >> np.arange(32)) & 1
                q[32 * w : 32 * w + 32] += bits * weight[k]
        ksums.append(int(rec[head : head + 4 * geometry.POPC_STEPS].view(np.int32)[j]))
        if j == 0:
            scales.append(float(rec[head + 4 * geometry.POPC_STEPS :][:4].view(np.float32)[0]))
    return q, ksums, scales


@pytest.mark.gpu
@pytest.mark.parametrize("H", [1408, 4096, 9216])  # partial k-steps; one piece; two pieces
def test_prep_launches_build_x_pieces_as_the_twin(H):
    """x's pieces for the one-token kernels, built by decode_prep and by route_prep from
    row-major x: every token's 16-bit planes, k-step sums and piece scales as the CPU twin
    quantizes x (popc.quantize), bit for bit; and beside them x in fragment order and out
    zeroed (route_prep's piece blocks do both)."""
    T, E, k, words = 3, 8, 2, H // 32
    spec = MoESpec(E, k, 64, H, "softmax_topk", True, 1.0, 0, False, "silu")
    gen = torch.Generator(device="cuda").manual_seed(H)
    x = torch.randn(T, H, generator=gen, device="cuda").half()
    x[1, ::97] *= 100  # outliers: a piece's scale is its own
    gw = (torch.randn(E, H, generator=gen, device="cuda") * 0.05).half()
    weights, index = route(F.linear(x, gw), spec)
    wpad = -(-words // 8) * 8
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    for how in ("decode", "routed"):
        poisoned = torch.full((T * popc.pieces(words) * geometry.PIECE_BYTES,), 0xAB, device="cuda")
        px = XPieces.over(poisoned.to(torch.uint8), words, T)
        out = torch.full((T, H), float("nan"), device="cuda")
        if how == "decode":
            _, xf = prepare_decode(x, index, weights, E, wpad, out, pieces=px)
        else:
            _, xf, _ = prepare_routed(x, gw, None, spec, wpad, out, done, pieces=px)
        assert torch.equal(xf, fragment_order(x, wpad)), how
        assert torch.equal(out, torch.zeros_like(out)), how
        for t in range(T):
            assert_pieces_as_the_twin(px.buf, words, t, x[t], how)


def assert_pieces_as_the_twin(buf: torch.Tensor, words: int, row: int, x: torch.Tensor, what):
    """Row `row`'s pieces in buf hold x (one row, fp16) as the CPU twin quantizes it
    (popc.quantize), bit for bit: each piece's 16-bit planes and scale, each k-step's sum."""
    q, ksums, scales = read_pieces(buf, words, row)
    xs = x.float().cpu()
    for pc, sx in enumerate(scales):
        steps = popc.step_words(words)[pc * geometry.POPC_STEPS :][: geometry.POPC_STEPS]
        cols = torch.tensor([32 * w + c for ws in steps for w in ws for c in range(32)])
        want_q, want_sx = popc.quantize(xs[cols])
        assert sx == pytest.approx(want_sx, rel=1e-6), (what, row, pc)
        assert np.array_equal(q[cols.numpy()], want_q.numpy()), (what, row, pc)
    for i, ws in enumerate(popc.step_words(words)):
        cols = [32 * w + c for w in ws for c in range(32)]
        assert ksums[i] == int(q[cols].sum()), (what, row, i)


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [768, 1408, 14336])  # Qwen3-MoE; partial k-steps; two pieces
def test_popc_planes_builds_h_pieces_as_the_twin(inter):
    """popc_planes turns each pair's h (fragment order, as gate_up stores it) into its pieces
    as the twin quantizes h, bit for bit (the one-token kernels' down reads h only so)."""
    spec = MoESpec(4, 2, 256, inter, "softmax_topk", True, 1.0, 0, False, "silu")
    moe = synthetic_layer(spec, device="cuda", seed=0).moe
    dn = moe.proj[(0, False, "down")]
    gen = torch.Generator(device="cuda").manual_seed(inter)
    h = torch.randn(3, 32 * dn.wpad, generator=gen, device="cuda").half()
    h[:, inter:] = 0  # h's padding columns, as gate_up writes them
    h[1, ::97] *= 100  # outliers: a piece's scale is its own
    buf = torch.full((3 * popc.pieces(dn.words) * geometry.PIECE_BYTES,), 0xAB, device="cuda")
    buf = buf.to(torch.uint8)
    moe._planes([(fragment_order(h, dn.wpad), dn, buf)])()
    for t in range(3):
        assert_pieces_as_the_twin(buf, dn.words, t, h[t, : 32 * dn.words], "h")


ROUTER_CASES = [  # experts, top-k, order, norm, scaling, shared gate, hidden, tokens
    (8, 2, "softmax_topk", True, 1.0, False, 4096, 1),  # Mixtral
    (8, 2, "softmax_topk", True, 1.0, False, 4096, 16),  # 32 pairs: the most group_few sorts
    (60, 4, "softmax_topk", False, 1.0, True, 2048, 5),  # Qwen1.5-MoE
    (128, 8, "softmax_topk", True, 1.0, False, 2048, 64),  # Qwen3-MoE
    (256, 8, "topk_softmax", False, 2.5, True, 1024, 17),
    (16, 4, "softmax_topk", True, 1.0, True, 2056, 3),  # 4 slices, the last one shorter
    (8, 2, "topk_softmax", True, 1.0, False, 16384, 2),  # 8 slices, two rounds of loads a lane
]


@pytest.mark.gpu
@pytest.mark.parametrize("E, k, order, norm, scaling, shared, H, T", ROUTER_CASES)
def test_route_prep_matches_torch_router(E, k, order, norm, scaling, shared, H, T):
    """One launch routes (router linear, the recipe's softmax / top-k, the shared gate) and
    prepares the decode: logits within fp16 rounding of torch's linear, top-k and weights as
    `route` gives them from those logits, pairs as `group`, x laid out, out zeroed. Twice: the
    kernel's completion counter must be back at zero for the second launch."""

    spec = MoESpec(E, k, 64, H, order, norm, scaling, 64 if shared else 0, shared, "silu")
    gen = torch.Generator(device="cuda").manual_seed(E + T)
    gw = (torch.randn(E, H, generator=gen, device="cuda") * 0.05).half()
    sgw = (torch.randn(1, H, generator=gen, device="cuda") * 0.05).half() if shared else None
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    wpad = -(-H // 256) * 8
    for _ in range(2):
        x = torch.randn(T, H, generator=gen, device="cuda").half()
        out = torch.full((T, H), float("nan"), device="cuda")
        pairs, xf, got = prepare_routed(x, gw, sgw, spec, wpad, out, done)
        logits = got.logits[:, :E]
        torch.testing.assert_close(logits, F.linear(x, gw).float(), rtol=2e-3, atol=2e-3)
        want_w, want_i = route(logits.half(), spec)
        # exact ties may order differently: compare the chosen logits and weights by rank
        torch.testing.assert_close(logits.gather(1, got.index), logits.gather(1, want_i))
        torch.testing.assert_close(got.weights, want_w, rtol=1e-5, atol=1e-6)
        if shared:
            want_s = torch.sigmoid(F.linear(x, sgw)).float().reshape(-1)
            torch.testing.assert_close(got.scale, want_s, rtol=2e-3, atol=1e-3)
        want = group(got.index, got.weights, E)
        for field in ("token", "weight", "lo", "hi"):
            assert torch.equal(getattr(pairs, field), getattr(want, field)), field
        assert torch.equal(xf, fragment_order(x, wpad))
        assert torch.equal(out, torch.zeros_like(out))
        assert int(done) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qwen-moe", "qwen3-moe"])
@pytest.mark.parametrize("T", [4, 1])
def test_routed_decode_matches_reference(shape, T):
    """`FusedMoE.routed` (router folded into the decode launch) against the torch path on the
    routing it chose, eager and replayed from a CUDA graph on new tokens. One token: on the
    binary tensor-core kernels, x's pieces built by route_prep. The eager calls reuse their
    launches (`_routed_plans`): new x and router tensors, and new widths, must reach them, a
    block past the one-token build's mma (`_past_mma`: its gate_up grid) among them."""
    layer = synthetic_layer(SHAPES[shape], seed=3)
    layer.set_widths(np.full(layer.table.n_blocks, 3))
    spec, gen = layer.spec, torch.Generator(device="cuda").manual_seed(0)
    gw = (torch.randn(spec.num_experts, spec.hidden, generator=gen, device="cuda") * 0.05).half()
    sgw = torch.randn(1, spec.hidden, generator=gen, device="cuda").half() * 0.05
    sgw = sgw if spec.has_shared else None
    x = torch.randn(T, spec.hidden, generator=gen, device="cuda").half()
    layer.moe.rules = replace(layer.moe.rules, popc_decode=T == 1)

    def check(out: torch.Tensor, case: str) -> None:
        r = layer.moe._routing[(T, sgw is not None)]
        logits = F.linear(x, gw).float()  # the router read this call's x and weights
        torch.testing.assert_close(r.logits[:, : spec.num_experts], logits, rtol=2e-3, atol=2e-3)
        want = layer.moe(0, x, r.weights, r.index, r.scale, reference=True)
        err = float((out - want).norm() / want.norm())
        assert err < 1e-3, f"{shape} T {T} {case}: relative error {err:.2e}"

    _poison(layer.moe)
    check(layer.moe.routed(0, x, gw, sgw)[0].clone(), "eager")
    x = torch.randn(T, spec.hidden, generator=gen, device="cuda").half()  # new tensors
    gw = (torch.randn(spec.num_experts, spec.hidden, generator=gen, device="cuda") * 0.05).half()
    check(layer.moe.routed(0, x, gw, sgw)[0].clone(), "eager, new x and router")
    layer.set_widths(np.full(layer.table.n_blocks, 4))  # one token: p1b3 -> p1
    check(layer.moe.routed(0, x, gw, sgw)[0].clone(), "eager, 4 bits")
    assert len(layer.moe._routed_plans) == (2 if T == 1 else 1)
    widths = np.full(layer.table.n_blocks, 4)
    widths[layer.moe._layer_blocks[0][::4]] = 6  # one token: p1b5, blocks past its mma
    layer.set_widths(widths)
    check(layer.moe.routed(0, x, gw, sgw)[0].clone(), "eager, some blocks at 6 bits")
    assert len(layer.moe._routed_plans) == (3 if T == 1 else 1)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer.moe.routed(0, x, gw, sgw)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out, _ = layer.moe.routed(0, x, gw, sgw)
    for seed in (1, 2):
        x.copy_(torch.randn(T, spec.hidden, generator=gen, device="cuda").half())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out.clone(), f"replay {seed}")


@pytest.mark.gpu
def test_token_tiles_kernel_matches_wgmma_tiles():
    from pwctl.runtime.moe.layouts import token_tiles

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(40, 300, generator=gen, device="cuda")
    hi = torch.tensor([0, 130, 131, 300, 300], device="cuda")  # slots of 130, 1, 169, 0 pairs
    token = torch.randint(0, 40, (300,), generator=gen, device="cuda", dtype=torch.int32)
    pairs = Pairs(token, torch.ones(300, device="cuda"), hi[:4].int(), hi[:4].int(), hi[1:].int())
    plan = tile_plan(pairs)
    got = token_tiles(x, 16, pairs, plan.info)
    want = wgmma_tiles(x, 16, token[plan.pair].long()).reshape(plan.tiles, -1)
    live = plan.info[:, 0] >= 0  # the kernel leaves tiles past the last real one unwritten
    assert int(live.sum()) == 5 and torch.equal(got[live], want[live])


PREP_CASES = [(1, 2, 8), (37, 2, 8), (512, 2, 8), (300, 8, 128), (2048, 8, 60)]


@pytest.mark.gpu
@pytest.mark.parametrize("T, k, E", PREP_CASES)
def test_prefill_prep_matches_group_and_tile_plan(T, k, E):
    gen = torch.Generator(device="cuda").manual_seed(T + E)
    logits = torch.randn(T, E, generator=gen, device="cuda")
    logits[:, : E // 4] -= 50.0  # a quarter of the experts get no token: empty slots
    weights, index = torch.topk(torch.softmax(logits, -1), k)
    out = torch.full((T, 96), float("nan"), device="cuda")
    pairs, info = prepare_prefill(index, weights, E, out)
    want = group(index, weights, E)
    for name in ("token", "weight", "lo", "hi"):
        assert torch.equal(getattr(pairs, name), getattr(want, name)), name
    filled = want.hi > want.lo  # empty slots may name any expert
    assert filled.sum() < filled.numel() or T == 1  # the cases hold empty slots
    assert torch.equal(pairs.expert[filled], want.expert[filled])
    plan = tile_plan(want)
    assert torch.equal(info, plan.info)  # dead tiles too: slot -1, pass the live count
    assert out.eq(0).all()


def test_device_table_sync_uploads_what_changed():
    spec = MoESpec(4, 2, 64, 96, "softmax_topk", False, 1.0, 0, False, "silu")
    layer = synthetic_layer(spec, device="cpu", seed=2)
    t, dt = layer.table, layer.dt
    assert torch.equal(dt.width, torch.from_numpy(t.width.astype(np.int32)))
    t.width[3] = 4
    t.slab_map[[0, 1]] = t.slab_map[[1, 0]]
    dt.sync()
    assert torch.equal(dt.width, torch.from_numpy(t.width.astype(np.int32)))
    assert torch.equal(dt.slab_map, torch.from_numpy(t.slab_map))
    dt.sync()  # nothing changed: still equal
    assert torch.equal(dt.slab_map, torch.from_numpy(t.slab_map))


def test_kernel_targets_take_the_worst_covered_row():
    def row(shape, width, tokens, path, pct, floor, grouped):
        return KernelRow(shape, width, tokens, path, 1.0, 1, 1.0, pct, 1.0, floor, 1.0, grouped,
                         1.0)  # fmt: skip

    rows = [
        row("m", "4", 1, "routed", 75.0, 2.6, 3.0),
        row("m", "3", 4, "routed", 65.0, 2.0, 3.0),  # the worst 3-4 bit row: 65% < 70%
        row("m", "8", 1, "routed", 10.0, 0.1, 0.1),  # not covered (8 bits)
        row("m", "4", 16, "routed", 10.0, 0.1, 0.1),  # not covered (16 tokens)
        row("m", "4", 1, "decode", 10.0, 0.1, 0.1),  # not covered (routing given: no router)
        row("m", "4", 512, "prefill", 5.0, 0.2, 0.7),
        row("q", "4", 512, "prefill", 5.0, 0.2, 0.5),
    ]
    got = {(c["target"], c["shape"]): (c["worst"], c["met"]) for c in against_targets(rows)}
    copy, floor, grouped, prefill = (t.name for t in TARGETS)
    assert got == {
        (copy, "m"): (65.0, False),
        (floor, "m"): (2.6, True),
        (grouped, "m"): (3.0, True),
        (prefill, "m"): (0.7, True),
        (prefill, "q"): (0.5, False),
    }


def test_fp16_baseline_computes_the_layer_with_its_shared_expert():
    """The bench's FP16 baseline is the same MoE layer as the kernels' reference: routed experts
    and the shared expert times its gate, in both its forms (grouped_mm, a GEMM an expert)."""
    from pwctl.bench.kernels import GroupedFp16, _spec

    spec = _spec(256, 128, 8, 2, shared=192)
    layer = synthetic_layer(spec, device="cpu", seed=1)
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    x, weights, index, scale = random_routing(spec, 5, device="cpu", seed=5)
    want = layer.moe(0, x, weights, index, scale, reference=True)
    fp16 = GroupedFp16(layer, x, weights, index, scale)
    for grouped in (fp16.grouped, False):  # grouped_mm where torch has it, and the loop
        fp16.grouped = grouped
        got = fp16().float()
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()), grouped
    with pytest.raises(ValueError, match="shared expert"):
        GroupedFp16(layer, x, weights, index)


def test_bench_kernels_streams_rows_then_prints_tables(monkeypatch, tmp_path):
    """`pwctl bench --kernels`, its device work replaced: each row goes to stderr as soon as
    _measure returns it (what a time-limited device run keeps), then the tables and the JSON."""
    import json

    from typer.testing import CliRunner

    import pwctl.bench.kernels as kb
    from pwctl.cli import app

    class Layer:  # the parts of a SyntheticLayer the loop touches
        table = type("T", (), {"min_bits": 2, "max_bits": 8, "n_blocks": 3})()

        def set_widths(self, w):
            self.w = w

    measured = []

    def measure(layer, name, width, T, copy_bw, seed):
        row = KernelRow(name, width, T, "decode", 10.0 * T, 2_000_000, 200.0, 5.0, 1.0, 0.1,
                        2.0, 0.2, 8.0 * T)  # fmt: skip
        measured.append(row)
        return [row]

    monkeypatch.setattr(kb, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(kb, "synthetic_layer", lambda spec, seed: Layer())
    monkeypatch.setattr(kb, "_measure", measure)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    seen = []
    real = kb.run_kernel_bench

    def run(*args, on_row=None, **kw):  # record what the command's on_row is handed, in order
        return real(*args, on_row=lambda r: (seen.append(r), on_row(r)), **kw)

    monkeypatch.setattr(kb, "run_kernel_bench", run)
    out = tmp_path / "k.json"
    args = ["bench", "--kernels", "--shape", "mixtral", "--width", "4", "--width", "mixed"]
    res = CliRunner().invoke(app, args + ["--tokens", "1", "--tokens", "4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert seen == measured and len(seen) == 4
    assert "fused MoE layer, Test GPU (copy 4.00 TB/s)" in res.output
    assert "mixtral  mixed  4  decode  40.0" in res.output  # a streamed progress line
    saved = json.loads(out.read_text())
    assert [(r["width"], r["tokens"]) for r in saved["rows"]] == [
        ("4", 1),
        ("4", 4),
        ("mixed", 1),
        ("mixed", 4),
    ]
    assert len(kb.row_cells(seen[0])) == len(kb.ROW_COLUMNS)


def test_pdl_launch_structs_match_the_driver_abi():
    """cuLaunchKernelEx reads CUlaunchConfig / CUlaunchAttribute (cuda.h, 64-bit): the ctypes
    mirrors must have the driver's sizes and field offsets, or the launch reads garbage."""
    cfg, attr = launch._LaunchConfig, launch._LaunchAttr
    assert ctypes.sizeof(attr) == 72 and attr.value.offset == 8
    assert (cfg.shared_mem.offset, cfg.stream.offset, cfg.attrs.offset) == (24, 32, 40)
    assert cfg.num_attrs.offset == 48 and ctypes.sizeof(cfg) == 56


def test_kernel_parameters_pack_at_their_natural_alignment():
    """cuLaunchKernel's `extra` buffer: each parameter at its own alignment, in order, the size
    ending at the last one (the CUDA driver API's rule); the `extra` array points at both."""
    args = (np.int32(-3), np.uint64(2**63 + 5), np.int32(7), np.int64(-9), np.float32(1.5),
            np.uint32(0xF000_0001))  # fmt: skip
    layout = launch.param_layout(tuple(map(type, args)))
    assert layout.size == 40  # int32 @0, pointer @8, int32 @16, int64 @24, float @32, uint @36
    params = launch._Params()
    extra = params.pack(args)
    raw = params.data.raw[: params.size.value]
    assert params.size.value == 40
    assert int.from_bytes(raw[36:40], "little") == 0xF000_0001
    assert int.from_bytes(raw[0:4], "little", signed=True) == -3
    assert int.from_bytes(raw[8:16], "little") == 2**63 + 5
    assert int.from_bytes(raw[16:20], "little") == 7
    assert int.from_bytes(raw[24:32], "little", signed=True) == -9
    assert np.frombuffer(raw[32:36], np.float32)[0] == 1.5
    pointers = (ctypes.c_void_p * 5).from_address(extra)
    assert [pointers[0], pointers[2], pointers[4]] == [1, 2, None]  # the driver's markers
    assert pointers[1] == ctypes.addressof(params.data)
    assert pointers[3] == ctypes.addressof(params.size)


def test_prepared_launch_fills_its_holes_each_call(monkeypatch):
    """A Prepared launch packs its arguments once; each call writes its pointers into the holes,
    and the driver gets the bytes `launch` packs for the same arguments."""
    seen = []

    def record(name, grid, block, extra, *args, **kw):
        seen.append(launch._params.data.raw[: launch._params.size.value])

    monkeypatch.setattr(launch, "launch_packed", record)
    u, i = np.uint64, np.int32
    args = (u(0), i(7), u(0), np.int64(-2), np.float32(0.5), u(99))
    prepared = launch.Prepared("k", (1,), (32,), args, holes=(0, 2))
    for a, b in ((11, 22), (2**63 + 1, 0)):
        prepared(a, b)
        launch.launch("k", (1,), (32,), (u(a), i(7), u(b), np.int64(-2), np.float32(0.5), u(99)))
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2]
    with pytest.raises(ValueError, match="pointers"):
        launch.Prepared("k", (1,), (32,), args, holes=(1,))


def _kernel_params(name: str, variant: registry.Variant = registry.DEFAULT) -> list[str]:
    """The parameter names of kernel `name` in cuda/ (GATE_UP_ENTRY, DOWN_ENTRY: the decode
    kernels' macros) in `variant`'s build, its argument-list macros expanded (a variant's
    arguments, BIAS_ARGS and ROUTER_BIAS_ARG, from their first definition where the variant
    has them, else empty)."""
    files = build.included([f"{family}.cu" for family in registry.FAMILIES], build.cuda_dir())
    src = "".join(p.read_text() for p in files).replace("\\\n", " ")
    at = src.index(f"#define {name}(") if name.endswith("_ENTRY") else 0
    name = "NAME" if at else name
    sig = src[src.index(f" {name}(", at) :].split(")", 1)[0].split("(", 1)[1]
    for macro in ("PAGED_ARGS", "SHARED_SLOT_ARGS", "SLOT_ARGS"):
        sig = sig.replace(macro, src.split(f"#define {macro} ", 1)[1].split("\n", 1)[0])
    for macro, on in (("BIAS_ARGS", variant.expert_bias), ("ROUTER_BIAS_ARG", variant.router_bias)):
        sig = sig.replace(
            macro, src.split(f"#define {macro} ", 1)[1].split("\n", 1)[0] if on else ""
        )
    return [p.split()[-1].lstrip("*") for p in sig.split(",")]


@pytest.mark.parametrize("H", [8, 1024, 1032, 2048, 4096, 7168, 8192, 16384, 65536])
def test_route_slices_bound_a_lanes_loads(H):
    """A router dot product takes the fewest warps (a power of two, at most a block's) that
    leave each lane ROUTE_LOADS 16-byte loads or fewer, and every warp of it some columns."""
    from pwctl.kernels.geometry import ROUTE_LOADS
    from pwctl.runtime.moe.prep import route_slices

    s, warps = route_slices(H), geometry.PREP_THREADS // 32
    assert s & (s - 1) == 0 and 1 <= s <= warps and warps % s == 0
    per_warp = -(-(H // 8) // s)  # cuda/route.cu router_logits: uint4s a slice
    assert per_warp <= 32 * ROUTE_LOADS or s == warps
    assert s == 1 or -(-(H // 8) // (s // 2)) > 32 * ROUTE_LOADS  # no fewer would do
    assert (s - 1) * per_warp < H // 8  # the last slice is not empty


def test_route_launch_holes_are_the_kernels_per_call_pointers(monkeypatch):
    """route_prep's launch keeps its buffers and takes x, the router's weights, the shared gate's
    and out at each call: its holes must be those parameters of the kernel (cuda/route.cu), and
    it must pass as many arguments as the kernel declares."""
    from pwctl.runtime.moe.prep import route_launch, routing_buffers

    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    cpu = torch.device("cpu")
    spec = MoESpec(8, 2, 64, 256, "softmax_topk", False, 1.0, 64, True, "silu")
    pairs, xf = decode_buffers(3, 2, 8, 8, cpu)
    routing = routing_buffers(3, spec, True, cpu)
    done = torch.zeros(1, dtype=torch.int32)
    prepared = route_launch(3, 256, spec, True, 8, done, pairs, xf, routing, None)
    names = _kernel_params("route_prep")
    assert prepared.count == len(names)
    assert [names[i] for i in prepared.holes] == ["x", "gate_w", "shared_gate_w", "out"]
    biased = route_launch(3, 256, spec, True, 8, done, pairs, xf, routing, None, registry.GPT_OSS)
    names = _kernel_params("route_prep", registry.GPT_OSS)
    assert biased.count == len(names) and names[biased.holes[-1]] == "router_bias"


def _one_token_call():
    """A CPU layer (4 experts top-2, a shared expert) and the buffers of its one-token decode
    call: the layer, pairs, x in fragment order, the shared expert's one-token slot."""
    cpu = torch.device("cpu")
    spec = MoESpec(4, 2, 4096, 768, "softmax_topk", False, 1.0, 256, True, "silu")
    layer = synthetic_layer(spec, device="cpu", seed=0)
    pairs, xf = decode_buffers(1, 2, 4, layer.moe.proj[(0, False, "gate")].wpad, cpu)
    return layer, pairs, xf, all_tokens(1, None, 4, cpu)


def test_slot_arguments_end_with_block_ids_and_their_rows():
    """The kernels that take the slots (SLOT_ARGS: the decode and prefill ones) take block_ids
    and its row count after them (`prefetch_ids` reads one row a CTA, and only rows that
    exist)."""
    pairs, _ = decode_buffers(1, 2, 4, 8, torch.device("cpu"))
    ids = torch.zeros(5, 3, dtype=torch.int32)
    args = pairs.kernel_args(ids)
    for name in ("GATE_UP_ENTRY", "DOWN_ENTRY"):
        names = _kernel_params(name)
        first = names.index("s_expert")
        assert names[first : first + len(args)][-2:] == ["block_ids", "n_ids"], name
        biased = _kernel_params(name, registry.GPT_OSS)  # then the biases (FusedMoE._slot_args)
        assert biased[first + len(args) : first + len(args) + 2] == [
            "s_bias_gate_up",
            "s_bias_down",
        ], name
    assert args[-2] == launch.ptr(ids) and args[-1] == 5


@pytest.mark.parametrize("popc_on", [False, True])
def test_decode_launch_hole_is_downs_out(monkeypatch, popc_on):
    """The decode launches are packed once for `routed`: gate_up has no hole, down one, its
    `out` parameter; both pass as many arguments as the kernels declare."""
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    monkeypatch.setattr(launch, "ctas_per_sm", lambda name, threads: 4)
    layer, pairs, xf, one = _one_token_call()
    layer.set_widths(np.full(layer.table.n_blocks, 4))  # the popc kernels read 4 bits
    moe = layer.moe
    moe.rules = replace(moe.rules, popc_decode=popc_on)
    px = moe._x_pieces(0, 1, torch.device("cpu"))
    assert (px is not None) == popc_on
    _, down = moe._decode_launches(0, xf, pairs, one, px)
    names = _kernel_params("DOWN_ENTRY")
    assert down.count == len(names) and [names[i] for i in down.holes] == ["out"]


def _run_shares(runs: int, tiles: int) -> list[tuple]:
    """cuda/lookup.cu RUN and gate_up_popc's loop replayed: (tile, kz, kn, idx) of each CTA's work
    on a persistent grid of `runs` CTAs over `tiles` tiles, in equal shares of the halves."""
    done, halves = [], 2 * tiles
    for j in range(runs):
        h, b = j * halves // runs, (j + 1) * halves // runs
        while h < b:
            kz = h & 1
            kn = 1 if kz == 0 and h + 2 <= b else 2
            done.append((h >> 1, kz, kn, j + 1 - kz))
            h += 2 if kn == 1 else 1
    return done


def _check_split_tiles(work: list[tuple], n_tiles: int, runs: int) -> dict[int, int]:
    """Each tile computed once whole, or once in each half by the two CTAs whose shares meet in
    it, which share its scratch; no two split tiles share one, and every index fits the
    launcher's runs + 1. The split tiles by scratch."""
    tiles = {}
    for tile, kz, kn, idx in work:
        tiles.setdefault(tile, []).append((kz, kn, idx))
    assert sorted(tiles) == list(range(n_tiles))
    split = {}
    for tile, parts in tiles.items():
        if parts != [(0, 1, parts[0][2])]:
            assert sorted(w[:2] for w in parts) == [(0, 2), (1, 2)] and parts[0][2] == parts[1][2]
            split[parts[0][2]] = tile
    assert len(split) == sum(len(w) == 2 for w in tiles.values())  # one scratch a split tile
    assert all(0 < idx <= runs for idx in split)
    return split


@pytest.mark.parametrize("runs", [1, 3, 100, 511, 512, 513, 1024])
def test_run_shares_cover_every_tile_once(runs):
    """The persistent gate_up grid's equal shares: every tile once (`_check_split_tiles`)."""
    split = _check_split_tiles(_run_shares(runs, 512), 512, runs)
    if runs <= 512:  # shares of at least a tile: at most one split tile between two CTAs
        assert len(split) < runs


def test_one_token_gate_up_shares_a_wave_with_the_shared_expert(monkeypatch):
    """With a shared expert, a one-token gate_up whose routed and shared tiles are more than a
    wave runs one wave of persistent CTAs, split between the two groups in proportion to their
    tiles (routed first in the grid, each group at least one CTA and at most one a half tile);
    under a wave, one CTA a tile. The split tiles' scratch covers both groups' shares. The
    routed ones take one CTA a tile where a block is wider than the build's binary mma."""
    assert geometry.gate_up_shares(528, 384, 352) == (275, 253)  # Qwen1.5-MoE, 4 bits
    assert geometry.gate_up_shares(528, 1792, 0) == (528, 0)
    assert geometry.gate_up_shares(0, 384, 352) == (0, 0)
    assert geometry.gate_up_shares(3, 384, 352) == (2, 1)
    assert geometry.gate_up_shares(2, 1, 1000) == (1, 1)
    assert geometry.gate_up_shares(10**6, 384, 352) == (768, 704)
    monkeypatch.setattr(geometry, "sm_count", lambda: 100)
    per_sm = {"n": 1}
    monkeypatch.setattr(launch, "ctas_per_sm", lambda name, threads: per_sm["n"])
    layer, _, xf, _ = _one_token_call()
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    moe = layer.moe
    routed = 2 * 32 * moe.proj[(0, False, "down")].wpad // geometry.ROWS  # 512
    shared = 32 * moe.proj[(0, True, "down")].wpad // geometry.ROWS  # 16
    plan = moe._decode_launch(0, 2, True, "p1")
    assert (plan.runs, plan.gate_up_grid) == (97, (100, 1))  # 100 * 512 / 528
    assert moe._run_args(plan, xf.device)[0] == 97
    widths = np.full(layer.table.n_blocks, 4)
    widths[moe._layer_blocks[0][0]] = 8
    layer.set_widths(widths)
    # by default a layer with a block past the build's mma takes one CTA a tile; a count of
    # CTAs set by hand still runs the wave
    assert moe._decode_launch(0, 2, True, "p1").runs == 0
    assert moe._decode_launch(0, 2, True, "p1b5").runs == 0  # an 8-bit block: past 5 bits too
    moe.rules = replace(moe.rules, gate_up_runs=97 + 3)
    assert moe._decode_launch(0, 2, True, "p1").runs == 97
    moe.rules = replace(moe.rules, gate_up_runs=None)
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    n = len(moe._run_buffers[next(iter(moe._run_buffers))][1])
    assert n == 97 + 1 + 3 + 1  # cuda/lookup.cu RUN: routed [1, 97], shared [99, 101]
    per_sm["n"], moe._launches = 6, {}  # a wave of 600 holds every tile: one CTA a tile
    plan = moe._decode_launch(0, 2, True, "p1")
    assert plan.runs == 0 and plan.gate_up_grid == (routed // 2, 2 + 1)
    assert shared <= routed // 2  # (the shared expert's tiles fit one extra grid row)


def test_one_token_gate_up_runs_a_persistent_grid(monkeypatch):
    """A one-token gate_up grid without a shared expert, more tiles than a wave, runs one wave of
    persistent CTAs (cuda/lookup.cu Run); under a wave, or with gate_up_runs = 0, one CTA a tile.
    Every build passes as many arguments as the kernels declare; a negative override raises."""
    assert geometry.gate_up_runs(1792, 528) == 528 and geometry.gate_up_runs(384, 528) == 0
    launched = []
    record = lambda name, grid, block, *args, **kw: launched.append((name, grid))  # noqa: E731
    monkeypatch.setattr(launch, "launch_packed", record)
    monkeypatch.setattr(geometry, "sm_count", lambda: 100)
    per_sm = {"n": 1}
    monkeypatch.setattr(launch, "ctas_per_sm", lambda name, threads: per_sm["n"])
    layer, pairs, xf, _ = _one_token_call()  # its shared expert stays out: no `shared` pairs
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    moe, cpu = layer.moe, torch.device("cpu")
    moe.rules = replace(moe.rules, popc_decode=True)
    tiles = 32 * moe.proj[(0, False, "down")].wpad // geometry.ROWS  # 256 a slot

    def grid(runs: int | None, ctas_per_sm: int = 1) -> tuple:
        moe.rules, per_sm["n"] = replace(moe.rules, gate_up_runs=runs), ctas_per_sm
        launched.clear()
        moe._decode(0, xf, pairs, torch.zeros(1, 768), None, moe._x_pieces(0, 1, cpu))
        return dict(launched)["gate_up_p1"]

    assert grid(None) == (100, 1) and grid(0) == (tiles, 2) and grid(7) == (7, 1)
    assert grid(None, ctas_per_sm=6) == (tiles, 2)  # 512 tiles, a wave of 600: one CTA a tile
    assert grid(10**6) == (4 * tiles, 1)  # at most a CTA a half tile
    gate_up, _ = moe._decode_launches(0, xf, pairs, None, None)  # the lookup build: no runs
    assert gate_up.count == len(_kernel_params("GATE_UP_ENTRY"))
    for knob in ("gate_up_runs", "down_split"):  # a negative count would shrink the grids
        with pytest.raises(ValueError, match=knob):
            DispatchRules(**{knob: -1})


def test_down_k_split_fills_the_gpu_or_one_wave(monkeypatch):
    """down's k-split: the lookup kernels split a tile's columns until CTAS_PER_SM an SM are
    busy; the popc kernels only as far as one wave of their CTAs holds (longer CTAs win there).
    Either way every warp keeps an 8-word iteration of the row."""
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    assert geometry.k_split(512, 448) == 3  # Mixtral's down, one token: ceil(8 x 132 / 512)
    assert geometry.k_split(512, 448, wave=528) == 1 == geometry.k_split(512, 448, wave=792)
    assert geometry.k_split(200, 448, wave=528) == 2 and geometry.k_split(64, 448, wave=528) == 8
    assert geometry.k_split(64, 24, wave=528) == 1  # 3 iterations: one warp each at most
    launched = []
    record = lambda name, grid, block, *args, **kw: launched.append((name, grid))  # noqa: E731
    monkeypatch.setattr(launch, "launch_packed", record)
    monkeypatch.setattr(launch, "ctas_per_sm", lambda name, threads: 1)
    layer, pairs, xf, _ = _one_token_call()
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    moe, cpu = layer.moe, torch.device("cpu")
    grids = {}
    for on in (True, False):
        moe.rules = replace(moe.rules, popc_decode=on)
        moe._decode(0, xf, pairs, torch.zeros(1, 768), None, moe._x_pieces(0, 1, cpu))
        grids.update(launched)
    ctas = 2 * 768 // geometry.ROWS  # two slots of 48 row tiles
    assert grids["down_p1"] == (ctas // 2, 2, 1)  # 132 // 96: one wave of one CTA an SM
    assert grids["down_n1"] == (ctas // 2, 2, 4)  # ceil(8 x 132 / 96), 4 iterations a warp


def test_decode_launches_take_pdl(monkeypatch):
    """Both decode launches start early (PDL) behind the launch before them, route_prep's too:
    route_prep lets gate_up in only from its last block (cuda/route.cu), so gate_up's CTAs do not
    sit on the SMs through the router."""
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    layer, pairs, xf, one = _one_token_call()
    gate_up, down = layer.moe._decode_launches(0, xf, pairs, one, None)
    assert gate_up.early and down.early


def test_modules_build_every_part_on_the_callers_device(monkeypatch, tmp_path):
    """`modules()` builds one RawModule a part, its program (`build.part_source`) with the
    device's options, each compiled in a pool thread under the caller's device (CuPy loads a
    module on the thread's current device); with PWCTL_CUBIN the one cubin serves every part. A
    stand-in for CuPy records what a GPU run would do."""
    compiled = []
    current = threading.local()

    class RawModule:
        def __init__(self, *, code=None, path=None, options=()):
            self.code, self.path, self.options = code, path, options

        def compile(self):
            compiled.append((self.code, getattr(current, "device", None)))

    @contextlib.contextmanager
    def device(index):
        current.device = index
        yield
        current.device = None

    runtime = SimpleNamespace(getDevice=lambda: 3)
    cuda = SimpleNamespace(runtime=runtime, Device=device)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(RawModule=RawModule, cuda=cuda))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    monkeypatch.setattr(build, "has_wgmma", lambda: False)
    monkeypatch.delenv("PWCTL_CUBIN", raising=False)
    launch.reload()
    try:
        mods = build.modules()
        wanted = [build.part_source(k) for k in range(len(registry.PARTS))]
        assert [m.code for m in mods] == wanted
        assert all(m.options == build.program_options("sm_80") for m in mods)
        assert sorted(compiled) == sorted((c, 3) for c in wanted)  # each once, on device 3
        for name in ("gate_up_n8", "down_pnb3", "route_prep", "down_prefill_wg"):
            assert build.module(name) is mods[registry.PART_OF[name]]
            made = (f"#define PWCTL_WANT_{name} 1", f"ENTRY({name}, ")
            assert any(m in build.module(name).code for m in made)
            others = [m for m in mods if m is not build.module(name)]
            assert not any(m in o.code for o in others for m in made)

        cubin = tmp_path / "whole.cubin"
        cubin.write_bytes(b"\x7fELF")
        monkeypatch.setenv("PWCTL_CUBIN", str(cubin))
        launch.reload()
        mods = build.modules()
        assert len(mods) == len(registry.PARTS) and {m.path for m in mods} == {str(cubin)}
        assert len(compiled) == len(wanted)  # a cubin is loaded as it is, never compiled
    finally:
        launch.reload()


def test_reload_forgets_the_module_and_its_handles(monkeypatch):
    """An A/B of kernel variants in one process (tools/kernel-dev/perf_kernel_ab.py) must launch
    the newly loaded module's functions, not handles cached from the one before."""
    loads = []

    @functools.cache
    def part_module(part, variant=registry.DEFAULT):
        loads.append(len(loads))
        handle = SimpleNamespace(kernel=SimpleNamespace(ptr=len(loads)))  # CUfunction of this load
        return SimpleNamespace(get_function=lambda name: handle)

    monkeypatch.setattr(build, "part_module", part_module)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    launch.reload()
    try:
        assert launch._handle("gate_up_n1", 0) == 1
        assert launch._handle("gate_up_n1", 0) == 1 and len(loads) == 1  # cached
        launch.reload()
        assert launch._handle("gate_up_n1", 0) == 2 and len(loads) == 2
    finally:
        launch.reload()  # no fake handle outlives the test


def test_balanced_split_evens_the_shared_experts_iterations():
    """Qwen1.5-MoE decode: routed down rows of 44 words (6 iterations of 8, 4 warps: 2 each),
    the shared expert's 176 (22 iterations): 3 CTAs a tile give its warps 2 each as well."""
    assert geometry.balanced_split(176, 4, 44, 4, 1) == 3
    assert geometry.balanced_split(44, 4, 44, 4, 1) == 1  # a group beside itself: no split
    assert geometry.balanced_split(24, 2, 176, 4, 1) == 1  # shorter rows: never below 1
    assert geometry.balanced_split(4096, 4, 44, 4, 1) == 64  # 512 iterations, 2 a warp
    assert geometry.balanced_split(40, 4, 8, 4, 1) == 1  # 5 iterations: one a warp at least


def test_down_groups_fit_a_shared_expert_in_one_wave(monkeypatch):
    """Qwen1.5-MoE's one-token down at 4 bits (wave 528: 4 CTAs on 132 SMs): routed rows of
    2048 x 44 words on 4 slots, the shared expert's 2048 x 176. k_split and balanced_split give
    128 x 4 routed CTAs and 128 x 3 shared ones, 896; the one-wave plan takes the routed tiles
    two m-tiles a CTA (64 x 4) and the shared expert's split 2 (128 x 2): 512, and every warp
    3 iterations of 8 words (routed 6 on 2 warps, shared 22 on 4 x 2)."""
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    routed, shared = (2048, 44), (2048, 176)
    r, t = geometry.down_groups(routed, 4, shared, 528, one_wave=False)
    assert (r.units, r.ctas, r.split, t.units, t.ctas, t.split) == (1, 128, 1, 1, 128, 3)
    r, t = geometry.down_groups(routed, 4, shared, 528)
    assert (r.units, r.ctas, r.split, t.units, t.ctas, t.split) == (2, 64, 1, 1, 128, 2)
    assert r.ctas * 4 * r.split + t.ctas * t.split == 512
    assert geometry.down_groups(routed, 4, shared, 2000) == geometry.down_groups(
        routed, 4, shared, 2000, one_wave=False
    )  # the default plan fits: kept
    r, t = geometry.down_groups(routed, 4, shared, None)  # the lookup kernels: no wave rule
    assert (r.units, r.split, t.split) == (1, 1, 3)
    r, t = geometry.down_groups(routed, 4, shared, 528, split=2)  # a given split is kept
    assert r.split == 2 and r.units == 1
    r, t = geometry.down_groups(routed, 4, None, 528)
    assert t is None and (r.units, r.split) == (1, 1)  # no shared expert: k_split's
    r, t = geometry.down_groups(routed, 60, shared, 528)  # nothing fits: the default plan
    assert (r.units, r.split) == (1, 1) and r.ctas * 60 > 528


@pytest.mark.parametrize("shared", [False, True])
def test_popc_kernels_by_default_on_a_layer_large_enough(monkeypatch, shared):
    """popc_decode None (the default) takes the popc kernels on blocks of at most 4 bits for
    one-token calls on a layer whose token reads at least P1_MIN_WEIGHTS expert weights (top-k
    routed experts' and the shared one's), and for calls of up to POPC_MAX_TOKENS tokens from
    POPC_MIN_WEIGHTS on; True and False force them on and off."""
    spec = MoESpec(4, 2, 4096, 768, "softmax_topk", False, 1.0, 256 if shared else 0, True, "silu")
    reads = 2 * 3 * 768 * 4096 + (3 * 768 * 256 if shared else 0)  # hidden 768
    cpu = torch.device("cpu")
    for one, few in ((reads, reads), (reads, reads + 1), (reads + 1, reads + 1)):
        rules = DispatchRules(p1_min_weights=one, popc_min_weights=few)
        layer = synthetic_layer(spec, device="cpu", seed=0, rules=rules)
        layer.set_widths(np.full(layer.table.n_blocks, 4))  # blocks the binary mma reads
        moe = layer.moe
        assert moe._weights_a_token(0) == reads
        assert (moe._x_pieces(0, 1, cpu) is not None) == (one <= reads)
        assert (moe._x_pieces(0, geometry.POPC_MAX_TOKENS, cpu) is not None) == (few <= reads)
        assert moe._x_pieces(0, geometry.POPC_MAX_TOKENS + 1, cpu) is None
        for forced in (True, False):
            moe.rules = replace(moe.rules, popc_decode=forced)
            assert (moe._x_pieces(0, 1, cpu) is not None) == forced


def test_pdl_configs_are_built_once_a_grid():
    """A PDL launch's CUlaunchConfig is made once per (grid, block, shared memory) and thread, with
    its programmatic-serialization attribute; a launch only sets its stream."""
    a = launch._pdl_config((4, 1, 1), (128, 1, 1), 0)
    assert launch._pdl_config((4, 1, 1), (128, 1, 1), 0) is a
    assert launch._pdl_config((8, 1, 1), (128, 1, 1), 0) is not a
    assert (a.grid[0], a.block[0], a.shared_mem, a.num_attrs) == (4, 128, 0, 1)
    assert (a.attrs.contents.id, a.attrs.contents.value[0]) == (6, 1)


@pytest.mark.gpu
def test_bench_rows_time_cold_and_warm_and_route():
    """`bench --kernels`' rows of a small synthetic layer (a shared expert, 2 tokens): every path
    timed with L2 flushed and back to back, and a `routed` row (the engine's call) whose bytes and
    FP16 floor are those of the experts its own router chose."""
    from pwctl.bench import kernels as kb

    spec = kb._spec(512, 256, 16, 4, shared=512)
    layer = kb.synthetic_layer(spec, seed=0)
    layer.set_widths(np.full(layer.table.n_blocks, 4))
    rows = kb._measure(layer, "tiny", "4", 2, kb.copy_bandwidth(1 << 26), seed=0)
    paths = [r.path for r in rows]
    assert paths[-1] == "routed" and {"decode", "lookup"} <= set(paths), paths
    for r in rows:
        assert r.time_us > 0 and r.warm_us > 0 and r.fp16_grouped_us > 0, r
        assert r.speedup_vs_floor == pytest.approx(r.fp16_floor_us / r.time_us)
    routed = rows[-1]
    x = random_routing(spec, 2, seed=2)[0].half()
    _, routing = layer.moe.routed(0, x, *kb.router_weights(spec, 0))
    assert routed.bytes_read == kb.active_bytes(layer, routing.index)[0]
