"""Where a decode layer's time goes: GPU time per kernel (torch.profiler over eager calls) against
the CUDA-graph replay time of the whole layer and an eager call's time (host work included: the
engine decodes eagerly), per shape and token count (4 bits). Graph minus kernels is what gaps
between dependent kernels cost; eager minus graph is the host's share. `popc`: one-token calls on
the binary tensor-core kernels too (popc_decode). `routed`: each call also with its router
in the first launch (`FusedMoE.routed`, random fp16 router weights x 0.05: route_prep instead of
decode_prep) on the launcher's choice of kernels. `timeline` (after the mode): also each kernel's
start and end inside a graph replay, from the replay's first kernel (median over replays), and
the gap before the replay. Usage (GPU machine):
  python3 recipes/profile_decode.py mixtral,qwen-moe,qwen3-moe 1,4,16 [popc | routed] [timeline]"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from pwctl.bench.kernels import capture_graph, decode_calls, event_time, graph_time, routed_call


def kernel_times(call, reps: int = 20) -> dict[str, float]:
    """Microseconds per call of each CUDA kernel `call` launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:40]] += e.device_time / reps
    return dict(total)


def replay_timeline(fn, reps: int = 20) -> str:
    """Each kernel of `fn`'s graph replay: name, start-end (us from the replay's first kernel's
    start), median over `reps` replays; and the median gap between replays (last kernel's end to
    the next replay's first start)."""
    graph = capture_graph(fn)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    ks = sorted(
        (e.time_range.start, e.time_range.end, e.name[:24])
        for e in prof.events()
        if e.device_type == cuda
    )
    n = len(ks) // reps
    if n == 0 or len(ks) != n * reps:
        return f"  timeline: {len(ks)} kernels over {reps} replays, not one set a replay"
    runs = [ks[i * n : (i + 1) * n] for i in range(reps)]
    med = statistics.median
    gap = med(runs[i][0][0] - max(e for _, e, _ in runs[i - 1]) for i in range(1, reps))
    parts = [
        f"{runs[0][j][2]} {med(r[j][0] - r[0][0] for r in runs):.1f}-"
        f"{med(r[j][1] - r[0][0] for r in runs):.1f}"
        for j in range(n)
    ]
    return f"  timeline (us): gap {gap:.1f} | " + " | ".join(parts)


def main() -> None:
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    mode, timeline = sys.argv[3:4], "timeline" in sys.argv[4:]
    paths = [False, True] if mode == ["popc"] else [False]
    for name, T, call in decode_calls(shapes, tokens):
        moe = call.func
        runs = [(f"{name}/popc" if p else name, p, call) for p in paths if T == 1 or not p]
        if mode == ["routed"]:  # the launcher's own choice of kernels (popc_decode None)
            runs.append((f"{name}/routed", None, routed_call(call)))
        for label, popc, fn in runs:
            moe.rules = replace(moe.rules, popc_decode=popc)
            graph_us, eager_us = graph_time(fn) * 1e6, event_time(fn) * 1e6
            times = kernel_times(fn)
            parts = "  ".join(f"{k} {v:.1f}" for k, v in sorted(times.items(), key=lambda i: -i[1]))
            head = f"{label:16s} T{T:3d} eager {eager_us:6.1f} us  graph {graph_us:6.1f} us"
            print(f"{head}  kernels {sum(times.values()):6.1f} us: {parts}", flush=True)
            if timeline:
                print(replay_timeline(fn), flush=True)


if __name__ == "__main__":
    main()
