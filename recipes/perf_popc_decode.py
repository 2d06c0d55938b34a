"""Prototype of docs/KERNELS.md's next step "the binary tensor-core dot product", for one token:
how close to copy bandwidth a decode GEMV gets when the lookup is replaced by plane ANDs and
mma.m16n8k256 .and.popc (recipes/perf_popc_decode.cu; the math: recipes/popc_decode_error.py).
Planes here are one flat array (no pages), tables are random sorted fp16 levels per row, x is
N(0, 1) with 8 outlier channels x50. Prints the fragment-layout check, each shape's error against
W x in fp64 (exact: against W (sx xi), the fixed-point x the kernel sees), and its time against
copy bandwidth and cuBLAS's FP16 GEMV of the same W, all measured in this run.
At one token it also times two variants that copy a CTA's plane words into shared memory with
Hopper's bulk copies (cp.async.bulk) before any mma: `tma`, a copy per (row, plane, column half),
and `tma_rows`, a copy per (plane, 8-row group), the whole row (docs/PERF.md, session 12).
`ring` times the persistent ring of bulk copies (`popc_ring`, session 13) at one token, `pair`
the ring shared by two warps that split the plane subsets (`popc_pair`).
`additive` times the GEMV on additive tables (no products of planes: `popc_add*`, session 21),
`deep` the same with D chunks in flight a warp and persistent CTAs (`popc_deep*`).
`tiles` times the fused `gate_up_p1`'s structure on flat planes (`popc_tiles*`, `popc_own*`,
session 27). POPC_TILED=1 reads the planes at pack format v2's tiled addresses (the sums are then
wrong, the bytes the same).
Usage (GPU machine): python3 recipes/perf_popc_decode.py [quick | probes | ring | pair | additive
| deep | tiles]
(quick: one token only; probes: `probes` below)"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import cupy as cp
import numpy as np

SHAPES = (  # (name, rows, cols, k-splits to try): a layer's routed experts stacked
    ("mixtral gate+up, 2 experts", 2 * 2 * 14336, 4096, (1,)),
    ("mixtral down, 2 experts", 2 * 4096, 14336, (2, 4)),
    ("qwen3-moe gate+up, 8 experts", 8 * 2 * 768, 2048, (1, 2)),
)


def event_us(fn, reps: int = 50) -> float:
    fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / reps


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 1 GiB device copy (pwctl bench's convention)."""
    a = cp.zeros(1 << 30, dtype=cp.uint8)
    b = cp.empty_like(a)
    return 2 * a.nbytes / event_us(lambda: b.__setitem__(Ellipsis, a), 20) * 1e6


def probe_layout(mod) -> bool:
    """One mma against the fragment layout the kernel assumes (that of m16n8k32 .s8, 32 bits a
    register): a0/a1 rows g/g+8 at k = 32t + i, a2/a3 the same at k = 128 + 32t + i; b0/b1 column g
    at those k; d: rows g, g + 8 x columns 2t, 2t + 1."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2**32, size=(32, 4), dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, size=(32, 2), dtype=np.uint64).astype(np.uint32)
    bits = lambda v: (v[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # noqa: E731
    A = np.zeros((16, 256), dtype=np.int64)
    Bm = np.zeros((256, 8), dtype=np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for half in range(2):
            k = slice(128 * half + 32 * t, 128 * half + 32 * t + 32)
            A[g, k] = bits(a[lane, 2 * half])
            A[g + 8, k] = bits(a[lane, 2 * half + 1])
            Bm[k, g] = bits(b[lane, half])
    D = A @ Bm
    want = np.array(
        [
            [
                D[lane >> 2, 2 * (lane & 3)],
                D[lane >> 2, 2 * (lane & 3) + 1],
                D[(lane >> 2) + 8, 2 * (lane & 3)],
                D[(lane >> 2) + 8, 2 * (lane & 3) + 1],
            ]
            for lane in range(32)
        ]
    )
    d = cp.zeros((32, 4), dtype=cp.int32)
    mod.get_function("probe")((1,), (32,), (cp.asarray(a), cp.asarray(b), d))
    return bool((cp.asnumpy(d) == want).all())


def subset_coefficients(levels: np.ndarray, bits: int) -> np.ndarray:
    """[rows, 16] fp32: c_S for plane subsets S (bit p of S: plane p, the label's bit bits-1-p),
    the Moebius transform of the table read by plane subset."""
    label = [sum(1 << (bits - 1 - p) for p in range(bits) if s >> p & 1) for s in range(1 << bits)]
    c = levels[:, label].astype(np.float64)
    for p in range(bits):
        for s in range(1 << bits):
            if s >> p & 1:
                c[:, s] -= c[:, s ^ (1 << p)]
    out = np.zeros((levels.shape[0], 16), dtype=np.float32)
    out[:, : 1 << bits] = c
    return out


def print_row(cells: Sequence[str]) -> None:
    """One markdown table row, then the memory pool emptied for the next shape's planes."""
    print("| " + " | ".join(cells) + " |", flush=True)
    cp.get_default_memory_pool().free_all_blocks()


def additive_levels(rng: np.random.Generator, rows: int, bits: int) -> np.ndarray:
    """[rows, 2^bits] fp16 tables T[l] = c_0 + sum_p c_p bit_p(l) with the c multiples of 2^-13
    and |T| < 0.25, so that fp16 holds every level exactly and the subsets of 2 or more planes
    have c_S = 0 exactly (what the `popc_add*` kernels assume)."""
    step = 0.01 * 2.0 ** np.arange(bits)[::-1]  # plane p: bit bits-1-p of the label
    c = np.round(step * (1 + 0.3 * rng.standard_normal((rows, bits))) * 2**13)
    c0 = -np.round(c.sum(1) / 2)
    label_bits = (np.arange(1 << bits)[:, None] >> np.arange(bits)[::-1]) & 1  # [2^b, planes]
    return ((c0[:, None] + (label_bits @ c.T).T) / 2**13).astype(np.float16)


def additive(mod, copy_bw: float) -> None:
    """The GEMV with additive tables (`popc_add*`): one mma a plane and k-step, no ANDs, at 4, 6
    and 8 CTAs an SM, 1, 2 and 4 tokens: how far a table format with no products of planes
    would let decode go."""
    for name, rows, cols, splits in SHAPES:
        for bits, tokens, ctas in itertools.product((3, 4), (1, 2, 4), (4, 6, 8)):
            cells = run_shape(
                mod, name, rows, cols, bits, tokens, splits[-1], False, copy_bw, add_ctas=ctas
            )
            print_row(cells)


DEEP = (  # bits, D, CTAs, additive tables (else today's: `popc_deepf*`)
    (4, 2, 4, True), (4, 4, 4, True), (3, 4, 5, True),
    (4, 1, 4, False), (4, 2, 4, False), (3, 2, 4, False), (3, 2, 5, False),
)  # fmt: skip


def deep(mod, copy_bw: float) -> None:
    """One token, D chunks in flight a warp, persistent CTAs, additive tables (`popc_deep*`) or
    every subset (`popc_deepf*`)."""
    for name, rows, cols, splits in SHAPES:
        for bits, d, ctas, add in DEEP:
            cells = run_shape(
                mod, name, rows, cols, bits, 1, splits[-1], False, copy_bw, deep=(d, ctas, add)
            )
            print_row(cells)


def x_fragments(xi: np.ndarray) -> np.ndarray:
    """The A fragments of xi's 16 bit planes: [chunks, 32 lanes, 2 k-steps, 4] u32, where lane
    (g, t) of chunk c holds, for k-step s, planes g and g + 8 at words 16c + 4t + 2s and + 1."""
    cols = xi.size
    u = (xi.astype(np.int64) & 0xFFFF).astype(np.uint64)
    bitsk = (u[None, :] >> np.arange(16, dtype=np.uint64)[:, None]) & 1  # [16, cols]
    words = (bitsk.reshape(16, cols // 32, 32) << np.arange(32, dtype=np.uint64)).sum(-1)
    words = words.astype(np.uint32)  # [16 planes, words]
    chunks = cols // 512
    out = np.zeros((chunks, 32, 2, 4), dtype=np.uint32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for s in range(2):
            w = 16 * np.arange(chunks) + 4 * t + 2 * s
            out[:, lane, s] = np.stack(
                [words[g, w], words[g + 8, w], words[g, w + 1], words[g + 8, w + 1]], -1
            )
    return out


def run_shape(
    mod,
    name: str,
    rows: int,
    cols: int,
    bits: int,
    tokens: int,
    splits: int,
    persist: bool,
    copy_bw: float,
    tma: str = "",
    probe: str = "",
    pad_smem: int = 0,
    ring: tuple[int, int, int, str] | None = None,
    add_ctas: int = 0,
    deep: tuple[int, int, bool] | None = None,
) -> list[str]:
    rng = np.random.default_rng(rows + cols + bits)
    words = cols // 32
    nbytes = bits * rows * words * 4
    copies = max(1, -(-400_000_000 // nbytes))  # > 8x the L2 between two reads of one copy
    planes = cp.random.randint(0, 256, size=copies * nbytes, dtype=cp.uint8)
    planes = planes.view(cp.uint32).reshape(copies, bits, rows, words)
    levels = np.sort(rng.standard_normal((rows, 1 << bits)) * 0.02, 1).astype(np.float16)
    if add_ctas or (deep and deep[2]):  # additive tables, exact in fp16 (2^-13 steps below 0.25)
        levels = additive_levels(rng, rows, bits)
    coef = cp.asarray(subset_coefficients(levels.astype(np.float64), bits))
    x = rng.standard_normal((tokens, cols))
    for k in range(tokens):
        x[k, rng.choice(cols, 8, replace=False)] *= 50
    sx = np.abs(x).max(1) / 32767
    xi = np.round(x / sx[:, None]).astype(np.int64)
    xa = cp.asarray(np.stack([x_fragments(v) for v in xi]))
    sxd, sumd = cp.asarray(sx, dtype=cp.float32), cp.asarray(xi.sum(1), dtype=cp.float32)
    y = cp.zeros((tokens, rows), dtype=cp.float32)
    kernel = mod.get_function(
        f"popc_deep{'' if deep[2] else 'f'}{bits}_{deep[0]}_{deep[1]}"
        if deep
        else f"popc_add{bits}_{tokens}_{add_ctas}"
        if add_ctas
        else f"popc_pair{bits}_{ring[1]}_{32 * ring[0]}"
        if ring and ring[3] == "pair"
        else f"popc_ring{ring[3]}{bits}_{ring[1]}"
        if ring
        else f"{probe}{bits}"
        if probe
        else f"popc_{tma}{bits}"
        if tma
        else f"popc_gemv{bits}_{tokens}"
    )
    grid = (-(-rows // (16 if tma else 64 if probe == "popc_loads16_" else 32)), splits)
    block, extra = (128,), ()
    smem = 0
    if ring:  # one CTA an SM, W warps of S stages of 8 rows x ch chunks x bits planes
        warps, stages, ch, kind = ring
        grid = (cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"], 1)
        block, extra = (32 * warps,), (cp.int32(ch),)
        rings = warps // 2 if kind == "pair" else warps  # a pair of warps shares a ring
        smem = rings * stages * bits * 8 * ch * 64 + (words // 16 * 1024 if kind else 0)
    if tma == "tma_rows":  # [group][plane][8 rows][words]
        smem = bits * 16 * words * 4
    elif tma:  # popc_tma's layout: [half][plane][16 rows] at a stride that spreads rows over banks
        per = -(-(words // 16) // splits)
        smem = 2 * bits * 16 * ((-(-per // 2) * 64 + 127) // 128 * 128 + 64)
    smem = max(smem, pad_smem)  # pad_smem: fewer CTAs an SM, whatever the registers allow
    if smem:
        kernel.max_dynamic_shared_size_bytes = smem
    if deep:  # persistent: the CTAs that fit at once (launch bounds), row groups strided
        sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
        grid = (min(grid[0], -(-sms * deep[1] // splits)), splits)
    if persist:  # as many CTAs as fit at once (launch bounds in the .cu), the warps loop
        sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
        fit = {1: 4, 2: 3 if bits == 3 else 2}[tokens]
        grid = (min(grid[0], -(-sms * fit // splits)), splits)

    def launch(i: int) -> None:
        args = (planes[i], cp.int32(rows), cp.int32(words), xa, coef, sxd, sumd, y)
        kernel(grid, block, args + extra, shared_mem=smem)

    launch(0)
    # reference on the GPU in fp64: labels from the planes, then the table
    p = planes[0]
    shifts = cp.arange(32, dtype=cp.uint32)
    label = cp.zeros((rows, cols), dtype=cp.int64)
    for k in range(bits):
        b = ((p[k][:, :, None] >> shifts) & 1).reshape(rows, cols).astype(cp.int64)
        label |= b << (bits - 1 - k)
    w = cp.take_along_axis(cp.asarray(levels.astype(np.float64)), label, 1)
    ref = cp.asarray(x) @ w.T
    exact = cp.asarray(xi * sx[:, None]) @ w.T
    del label, w
    err = float(cp.linalg.norm(y - ref) / cp.linalg.norm(ref))
    err_exact = float(cp.linalg.norm(y - exact) / cp.linalg.norm(exact))
    i = [0]

    def step() -> None:  # y not zeroed between timed launches: its values no longer matter
        i[0] = (i[0] + 1) % copies
        launch(i[0])

    us = event_us(step)
    w16 = cp.random.standard_normal(
        (max(1, -(-400_000_000 // (rows * cols * 2))), rows, cols), dtype=cp.float32
    ).astype(cp.float16)
    x16 = cp.asarray(x.T, dtype=cp.float16)
    j = [0]

    def gemm() -> None:
        j[0] = (j[0] + 1) % w16.shape[0]
        w16[j[0]] @ x16

    us16 = event_us(gemm)
    pct = 100 * nbytes / (us * 1e-6) / copy_bw
    floor = rows * cols * 2 / copy_bw * 1e6
    cells = (
        name,
        bits,
        tokens,
        splits,
        "yes" if persist else "no",
        f"{us:.1f}",
        f"{pct:.0f}%",
        f"{floor / us:.2f}x",
        f"{us16:.1f}",
        f"{us16 / us:.2f}x",
        f"{err:.1e}",
        f"{err_exact:.1e}",
    )
    if tma or probe:
        cells = (f"{name} ({tma or probe}, {smem >> 10} KB)",) + cells[1:]
    if add_ctas:
        cells = (f"{name} (additive tables, {add_ctas} CTAs an SM)",) + cells[1:]
    if deep:
        kind = "additive" if deep[2] else "every subset"
        cells = (f"{name} ({kind}, {deep[0]} chunks in flight a warp, persistent, "
                 f"{deep[1]} CTAs an SM)",) + cells[1:]  # fmt: skip
    if ring:
        warps, stages, ch, kind = ring
        what = {
            "": "",
            "x": ", x in shared memory",
            "p": ", x in shared memory, pipelined",
            "pair": ", a ring a pair of warps that split the subsets",
        }[kind]
        cells = (f"{name} (ring: {warps} warps, {stages} stages of {ch} chunks{what})",) + cells[1:]
    return [str(c) for c in cells]


def probes(mod, copy_bw: float) -> None:
    """What bounds the bare kernel: one chunk in flight a warp instead of two (`popc_one`), its
    loads without the mma (`popc_loads`; `popc_planes_only`: not even x's fragments), the same
    plane loads 16 rows a warp (`popc_loads16_`), the mma without the loads (`popc_mma`), at the
    occupancy their registers allow or at the GEMV's 4 CTAs an SM (shared memory padded to 52 KB a
    CTA), the GEMV and its plane loads with each warp starting at its own chunk (`*_rot`), and
    the 3-bit GEMV held to 4, 5 and 6 CTAs an SM (`popc_at*`).
    Probes compute no result: their errors mean nothing."""
    name, rows, cols, _ = SHAPES[0]
    # 3 bits at 4, 5, 6 CTAs an SM (shared memory padding holds the first two there)
    for probe, pad in (("popc_at4_", 52 << 10), ("popc_at5_", 44 << 10), ("popc_at6_", 0)):
        cells = run_shape(mod, name, rows, cols, 3, 1, 1, False, copy_bw, probe=probe, pad_smem=pad)
        print("| " + " | ".join(cells) + " |", flush=True)
    runs = (
        ("", 0),
        ("popc_one", 0),
        ("popc_loads", 0),
        ("popc_loads", 52 << 10),
        ("popc_planes_only", 52 << 10),
        ("popc_loads16_", 52 << 10),
        ("popc_rot", 0),
        ("popc_planes_rot", 52 << 10),
        ("popc_mma", 0),
    )
    for probe, pad in runs:
        cells = run_shape(mod, name, rows, cols, 4, 1, 1, False, copy_bw, probe=probe, pad_smem=pad)
        print_row(cells)


PAIRS = {  # the same for `popc_pair` (kind "pair"): warps 16, 24 or 30 (2 warps a ring)
    (0, 4): ((16, 2, 4, "pair"), (16, 3, 4, "pair"), (24, 2, 4, "pair"), (30, 2, 2, "pair")),
    (0, 3): ((24, 2, 4, "pair"), (30, 2, 4, "pair")),
    (1, 4): ((16, 3, 4, "pair"), (24, 2, 4, "pair")),
    (1, 3): ((24, 2, 4, "pair"), (30, 2, 4, "pair")),
    (2, 4): ((24, 2, 2, "pair"), (24, 2, 4, "pair")),
}

RINGS = {  # (shape index, bits): (warps, stages, chunks a stage, kind) to try; one CTA an SM.
    # kind "": x's fragments from global memory; "x": from shared memory; "p": and pipelined
    (0, 4): (
        (4, 3, 8, ""),
        (6, 2, 8, ""),
        (8, 3, 4, ""),
        (12, 2, 4, ""),
        (12, 2, 4, "x"),
        (12, 2, 4, "p"),
        (8, 3, 4, "x"),
        (8, 3, 4, "p"),
        (6, 2, 8, "p"),
    ),
    (0, 3): ((8, 2, 8, ""), (8, 2, 8, "p"), (8, 4, 4, "")),
    (1, 4): ((8, 3, 4, ""), (12, 2, 4, ""), (12, 2, 4, "x"), (12, 2, 4, "p")),
    (1, 3): ((8, 4, 4, ""),),
    (2, 4): ((4, 3, 4, ""), (12, 2, 2, ""), (12, 2, 2, "p")),
}


def rings(mod, copy_bw: float, table: dict) -> None:
    """The persistent ring (`popc_ring`): bulk copies keep S - 1 items a warp in flight while it
    computes, one CTA an SM (`popc_pair`: a ring a pair of warps)."""
    for (i, bits), configs in table.items():
        name, rows, cols, _ = SHAPES[i]
        for cfg in configs:
            cells = run_shape(mod, name, rows, cols, bits, 1, 1, False, copy_bw, ring=cfg)
            print_row(cells)


def main() -> None:
    quick = sys.argv[1:] == ["quick"]  # one token, no persistent CTAs
    # POPC_TILED=1: the GEMVs read planes at pack format v2's tiled addresses (a probe: the sums
    # are wrong, the bytes the same)
    tiled = ("-DTILED",) if os.environ.get("POPC_TILED") else ()
    mod = cp.RawModule(
        code=Path(__file__).with_suffix(".cu").read_text(), options=("-std=c++17", *tiled)
    )
    print("fragment layout as assumed:", probe_layout(mod))
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    print(
        "| shape | bits | tokens | k-splits | persistent | us | % copy | x FP16 floor | "
        "cuBLAS FP16 us | x cuBLAS | rel err vs W x | vs W (sx xi) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    if sys.argv[1:] == ["tiles"]:  # gate_up_p1's structure on flat planes (session 27)
        for name, rows, cols, _ in SHAPES[:2]:
            for bits in (3, 4):
                for probe in (
                    "popc_one",
                    "popc_share",
                    "popc_tiles",
                    "popc_tiles_nosync",
                    "popc_own",
                ):
                    cells = run_shape(mod, name, rows, cols, bits, 1, 1, True, copy_bw, probe=probe)
                    print_row(cells)
        return
    if sys.argv[1:] == ["probes"]:
        probes(mod, copy_bw)
        return
    if sys.argv[1:] == ["additive"]:
        additive(mod, copy_bw)
        return
    if sys.argv[1:] == ["deep"]:
        deep(mod, copy_bw)
        return
    if sys.argv[1:] in (["ring"], ["pair"]):
        rings(mod, copy_bw, RINGS if sys.argv[1] == "ring" else PAIRS)
        return
    for name, rows, cols, splits in SHAPES:
        for bits in (3, 4):
            for tokens in (1,) if quick else (1, 2):
                for k, persist in itertools.product(splits, (False,) if quick else (False, True)):
                    cells = run_shape(mod, name, rows, cols, bits, tokens, k, persist, copy_bw)
                    print_row(cells)
            for k, kind in ((1, "tma"), (1, "tma_rows")):  # one token, bulk copies to shared memory
                cells = run_shape(mod, name, rows, cols, bits, 1, k, False, copy_bw, tma=kind)
                print_row(cells)


if __name__ == "__main__":
    main()
