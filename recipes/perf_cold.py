"""A decode layer's time with its weights in L2 or not. Replayed back to back (how `bench
--kernels` timed decode rows until session 20; its `warm us` column now), a layer that fits in
L2 (a Qwen3-MoE token's experts: 20 MB, the H200's L2: 50 MB) is read from L2 after the first
replay, which a step through 48 layers never sees. Per shape and token count (4 bits), graph
replay us: `warm` (50 replays back to back) and `cold` (each replay timed alone after a read
that evicts the layer from L2: `cold_time`, median of 30); given routing, then the engine's
routed call. Usage (GPU machine):
  python3 recipes/perf_cold.py qwen3-moe,qwen-moe,mixtral 1,4"""

from __future__ import annotations

import sys

from pwctl.bench.kernels import decode_calls, graph_times, routed_call


def main() -> None:
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    for name, T, call in decode_calls(shapes, tokens):
        for label, fn in (("given routing", call), ("routed", routed_call(call))):
            cold, warm = (t * 1e6 for t in graph_times(fn))
            print(f"{name} T={T} {label}: warm {warm:.1f} us, cold {cold:.1f} us", flush=True)


if __name__ == "__main__":
    main()
