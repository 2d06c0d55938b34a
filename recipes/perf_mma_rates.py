"""Issue rates of mma.sync on this GPU: f16 m16n8k16, s8 m16n8k32, s4 m16n8k64 and b1 m16n8k256
(and.popc, xor.popc), in mma a clock an SM and operations a second. Behind docs/KERNELS.md's
next step "the binary tensor-core dot product" (a b1 mma does 16x the products of an f16 one;
does it issue as fast?).
Usage (GPU machine): python3 recipes/perf_mma_rates.py"""

from __future__ import annotations

from pathlib import Path

import cupy as cp

PRODUCTS = {"f16": 16 * 8 * 16, "s8": 16 * 8 * 32, "s4": 16 * 8 * 64, "b1_and": 16 * 8 * 256}
PRODUCTS["b1_xor"] = PRODUCTS["b1_and"]


def main(iters: int = 2000, warps: int = 8) -> None:
    mod = cp.RawModule(code=Path(__file__).with_suffix(".cu").read_text(), options=("-std=c++17",))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    clock = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrClockRate, 0) * 1e3
    out = cp.zeros(sms * 4 * 32 * warps, dtype=cp.float32)
    print("| mma | us | mma a clock an SM (max clock) | T products/s |")
    print("| --- | --- | --- | --- |")
    for name, products in PRODUCTS.items():
        kernel = mod.get_function(name)
        args = (cp.int32(iters), out)
        kernel((sms * 4,), (32 * warps,), args)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        kernel((sms * 4,), (32 * warps,), args)
        end.record()
        end.synchronize()
        seconds = cp.cuda.get_elapsed_time(start, end) / 1e3
        mmas = sms * 4 * warps * iters * 8
        rate = mmas / sms / seconds / clock
        tops = mmas * products / seconds / 1e12
        print(f"| {name} | {seconds * 1e6:.0f} | {rate:.3f} | {tops:.0f} |")


if __name__ == "__main__":
    main()
