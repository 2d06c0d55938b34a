"""A/B-time variants of the kernels with the `bench --kernels` harness, in one process, several
rounds interleaved (the best time of each is printed). Variants are folders of sources, each a
variant of cuda/ (NVRTC compiles each: minutes, docs/decisions/032-nvrtc-parts.md; e.g.
`mkdir /tmp/a && git archive main cuda | tar -x --strip-components=1 -C /tmp/a`), or cubins
built elsewhere (tools/kernel-dev/write_program.py, then nvcc: no compile on the GPU machine;
compare cubins with cubins).
A variant `x.cubin@runs=N@down=K@slab=S` runs x with DispatchRules.gate_up_runs = N (the CTAs of a
one-token gate_up's persistent grid; 0: one CTA a tile), down_split = K (CTAs sharing a down
tile's columns), and the synthetic layers paged over slabs of S bytes instead of the pager's
choice; `@popc=1` puts decode calls of up to POPC_MAX_TOKENS tokens on the popc kernels,
`@popc=0` on the lookup (popc_decode; without it, the launcher's rule); `@b5=0` keeps
one-token layers with blocks wider than 4 bits off the 5-bit popc build (popc_b5);
`@dwave=0` turns off down's one-wave plan beside a shared expert (down_one_wave);
`@sk=1` / `@sk=0` puts the sm_90a prefill's down on its stream-K wave or one CTA a unit
(down_stream_k). The knobs are DispatchRules fields (pwctl/runtime/moe/dispatch.py).
Usage (GPU machine):
  python3 tools/kernel-dev/perf_kernel_ab.py /tmp/a,/tmp/b mixtral,qwen3-moe 3,4 1,4 [rounds]"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

from pwctl.bench import kernels as bench
from pwctl.bench.kernels import run_kernel_bench
from pwctl.kernels import launch
from pwctl.runtime.moe.dispatch import DispatchRules

SYNTHETIC = bench.synthetic_layer


def main() -> None:
    variants, shapes, widths = (a.split(",") for a in sys.argv[1:4])
    tokens = [int(t) for t in sys.argv[4].split(",")]
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    best: dict[tuple, dict[str, float]] = {}
    for _ in range(rounds):
        for v in variants:
            path, *knobs = v.split("@")
            knob = dict(k.split("=") for k in knobs)
            rules = DispatchRules(
                gate_up_runs=int(knob["runs"]) if "runs" in knob else None,
                down_split=int(knob["down"]) if "down" in knob else None,
                down_one_wave=knob.get("dwave", "1") != "0",
                down_stream_k={"1": True, "0": False}.get(knob.get("sk", "")),
                popc_decode={"1": True, "0": False}.get(knob.get("popc", "")),
                popc_b5=knob.get("b5", "1") != "0",
            )
            slab = int(knob["slab"]) if "slab" in knob else None
            bench.synthetic_layer = functools.partial(SYNTHETIC, slab_bytes=slab, rules=rules)
            if path.endswith(".cubin"):
                os.environ["PWCTL_CUBIN"] = str(Path(path).resolve())
            else:
                os.environ.pop("PWCTL_CUBIN", None)
                os.environ["PWCTL_CUDA_DIR"] = str(Path(path).resolve())
            launch.reload()
            for row in run_kernel_bench(shapes, widths, tokens)[1]:
                times = best.setdefault((row.shape, row.width, row.tokens, row.path), {})
                times[v] = min(times.get(v, float("inf")), row.time_us)
            torch.cuda.synchronize()
    for key, times in sorted(best.items()):
        print(*key, "  ".join(f"{Path(v).name}={t:8.1f}" for v, t in times.items()))


if __name__ == "__main__":
    main()
