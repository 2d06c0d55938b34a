"""How fast can a decode CTA's plane words stream, with no lookup and no mma? Bare kernels that read
B planes x R rows x W words (u32) the way the decode kernels do (a CTA: 16 rows, 4 warps splitting
the 8-word iterations) and only xor what they read, at the decode kernels' occupancy (extra shared
memory holds an SM to `ctas` CTAs). Variants:
  reg    lane (g, t) loads words 8 it + t and 8 it + 4 + t of rows g and g + 8 into registers,
         one iteration ahead (today's decode loop)
  reg64  the same words as one 8-byte load a (plane, row): words 8 it + 2t, + 1
  reg128 16-byte loads: words 16 it + 4t .. + 3 (4 words a (plane, row) and lane)
  ring   a per-warp ring of cp.async copies in shared memory, 2 stages of one iteration ahead
  +pro   each CTA first waits on a chain of 5 dependent loads (what `stage` does before a
         CTA's first plane word: slot, block, width, slab offset, slab map); "miss": through a
         256 MB table, so that they miss the caches
  streams 2: a CTA streams two 16-row tiles one after the other, its pipeline drained between
         them (as `gate_up` does gate's rows, then up's)
Usage (GPU machine): python3 recipes/perf_plane_streaming.py"""

from __future__ import annotations

from pathlib import Path

import cupy as cp

# (CTAs an SM at most, streams a CTA, prologue)
CONFIGS = (
    (6, 1, ""),
    (6, 1, "+pro"),
    (6, 1, "+pro miss"),
    (6, 2, ""),
    (6, 2, "+pro miss"),
    (10, 1, ""),
)
SHAPES = (("mixtral gate_up, 1 token", 2 * 2 * 14336, 128), ("W=448, 704 MB", 8 * 3 * 4096, 448))
# (kernel, label, planes)
VARIANTS = (
    ("reg4", "reg", 4),
    ("reg64_4", "reg64", 4),
    ("reg128_4", "reg128", 4),
    ("ring4", "ring", 4),
    ("reg3", "reg", 3),
    ("ring3", "ring", 3),
)


def time_us(kernel, grid: int, args: tuple, smem: int, reps: int = 20) -> float:
    kernel((grid,), (128,), args, shared_mem=smem)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        kernel((grid,), (128,), args, shared_mem=smem)
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / reps


def main() -> None:
    mod = cp.RawModule(code=Path(__file__).with_suffix(".cu").read_text(), options=("-std=c++17",))

    def chain(n: int) -> tuple:
        return cp.random.randint(0, n, size=n, dtype=cp.int32), n - 1, 1

    # prologue: none, 5 loads that hit (a 4 KB table), 5 that miss (a 256 MB table)
    chains = {"": (cp.zeros(1, dtype=cp.int32), 0, 0), "+pro": chain(1 << 10)}
    chains["+pro miss"] = chain(1 << 26)
    print("| data | variant | planes | CTAs an SM (at most) | streams a CTA | us | TB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rows, words in SHAPES:
        planes = cp.random.randint(0, 2**31, size=(4, rows, words), dtype=cp.int64)
        planes = planes.astype(cp.uint32)
        out = cp.zeros(rows // 16, dtype=cp.uint32)
        for kname, variant, bits in VARIANTS:
            kernel = mod.get_function(kname)
            for ctas, streams, pro in CONFIGS:
                table, mask, on = chains[pro]
                need = 4 * 2 * bits * 16 * 12 * 4 if kname.startswith("ring") else 0
                smem = max(need, (227 * 1024) // ctas - 1024 - 64)  # at most `ctas` CTAs an SM
                kernel.max_dynamic_shared_size_bytes = smem
                args = (planes, cp.int64(rows * words), cp.int32(words), table, cp.int32(mask))
                args += (cp.int32(on), cp.int32(streams), out)
                us = time_us(kernel, rows // 16 // streams, args, smem)
                tbs = bits * rows * words * 4 / us / 1e6
                cells = (name, variant + pro, bits, ctas, streams, f"{us:.1f}", f"{tbs:.2f}")
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)
        del planes


if __name__ == "__main__":
    main()
