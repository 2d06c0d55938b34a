"""Where one decode step of the serving engine goes: wall time a step (`--seqs` sequences, all
decoding, GPU synced after each step), the GPU's busy time in the same steps (torch.profiler: the
union of its kernels' intervals, against the unprofiled step's wall time), and
cProfile's top functions. Wall time past the GPU's is host time (decode steps replay CUDA graphs
unless --eager). `--graph-sdpa BACKEND` captures the graphs with one SDPA backend instead of
torch's choice (cuDNN on the H200, whose plan per new shape is most of a capture: an experiment,
see `decode_graph_capture_s` in the printed stats). Usage (GPU machine; any pack, e.g. `pwctl
convert tiny-mixtral PACK`):
  python3 recipes/profile_engine_step.py PACK POLICY [STEPS] [--seqs N] [--max-bits B] [--device D]
      [--eager] [--no-overlap] [--memory-budget SIZE]
      [--graph-sdpa cudnn|efficient|math]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel

from pwctl.bench.throughput import prompt_windows
from pwctl.build.checkpoint import EVAL_SAMPLE
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.decode_graphs import DecodeGraphs
from pwctl.runtime.engine.engine import Engine, experts_for, open_pack, serving_dtype
from pwctl.runtime.engine.scheduler import SamplingParams

GRAPH_SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "math": SDPBackend.MATH}  # fmt: skip


def capture_with(backend: SDPBackend) -> None:
    """Decode graphs captured (their eager first run included) with `backend` alone for SDPA."""
    capture = DecodeGraphs._capture

    def wrapped(self, *args):
        with sdpa_kernel([backend]):
            return capture(self, *args)

    DecodeGraphs._capture = wrapped


def synced(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def decoding_engine(
    pack: str, policy_text: str, device: str, max_bits: int | None, prompt_len: int, tokens: int,
    cuda_graphs: bool = True, seqs: int = 1, overlap: bool = True, budget: str | None = None,
) -> Engine:  # fmt: skip
    """The serving engine of `pack` at `policy_text` with `seqs` sequences queued: each a
    `prompt_len`-token window of the bundled eval text that will decode `tokens` tokens."""
    policy = parse_policy(policy_text)
    experts = experts_for(policy, device)
    engine = Engine(open_pack(pack), device, serving_dtype(device, experts), experts, max_bits)
    # with a budget, the context is what the run uses (as bench --throughput sets it)
    longest = prompt_len + tokens if budget is not None else None
    cfg = BatchConfig(max_seqs=seqs, cuda_graphs=cuda_graphs, overlap=overlap,
                      max_model_len=longest)  # fmt: skip
    engine.start_batching(policy, budget, cfg)
    for ids in prompt_windows(engine.tokenizer, EVAL_SAMPLE, seqs, prompt_len):
        engine.add_request(ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
    return engine


def gpu_busy_us(prof: torch.profiler.profile) -> tuple[float, int]:
    """Microseconds the GPU ran anything (the union of its kernels' and copies' intervals, so
    overlapping streams count once) and how many ran. Summing `key_averages()` rows would count
    each kernel twice: under the op that launched it and as a row of its own."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy, len(spans)


def graph_alone(engine: Engine, steps: int) -> None:
    """Replay the last step's decode graph `steps` times back to back, the host doing nothing
    between replays: its wall time a replay is what the GPU needs for a step's forward, and its
    busy share the most the engine's steps can show with this many kernels (a graph's kernels
    wait on each other's launch on the GPU; no host is involved). The engine's step against
    it is what the host adds. Run last: replays rewrite the step's cache rows."""
    graphs = engine.batcher.runner.graphs
    if graphs is None or not graphs._graphs:
        return
    graph = next(reversed(graphs._graphs.values()))
    graph.replay()
    t0 = synced("cuda")
    for _ in range(steps):
        graph.replay()
    alone = (synced("cuda") - t0) / steps * 1e3
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            graph.replay()
        synced("cuda")
    busy = gpu_busy_us(prof)[0] / steps / 1e3
    print(
        f"graph alone: {alone:.2f} ms a replay, GPU busy {busy:.2f} ms ({busy / alone:.0%}: "
        "the in-graph bound on the busy share)"
    )


def host_outside_forward(engine: Engine, device: str, steps: int) -> None:
    """Print the host's time a step outside the model's forward (scheduling, sampling, reading
    tokens, detokenization, the planner): with overlapped steps on the GPU, what must fit in the
    GPU's step for the GPU never to wait."""
    runner = engine.batcher.runner
    inside = [0.0]
    forward = runner.forward

    def timed(*args, **kw):
        start = time.perf_counter()
        try:
            return forward(*args, **kw)
        finally:
            inside[0] += time.perf_counter() - start

    runner.forward = timed  # type: ignore[method-assign]  # this instance only, then put back
    t0 = synced(device)
    for _ in range(steps):
        engine.step()
    wall = synced(device) - t0
    runner.forward = forward  # type: ignore[method-assign]
    print(f"host outside the forward: {(wall - inside[0]) / steps * 1e3:.2f} ms a step of "
          f"{wall / steps * 1e3:.2f} (the forward's host side, launches included: "
          f"{inside[0] / steps * 1e3:.2f})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pack")
    ap.add_argument("policy")
    ap.add_argument("steps", type=int, nargs="?", default=32)
    ap.add_argument("--max-bits", type=int)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--seqs", type=int, default=1, help="sequences decoding in each step")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument("--no-overlap", action="store_true", help="read each step's tokens first")
    ap.add_argument("--memory-budget", help="as serve/bench take it (default: the engine's)")
    ap.add_argument("--graph-sdpa", choices=sorted(GRAPH_SDPA))
    a = ap.parse_args()
    if a.graph_sdpa:
        capture_with(GRAPH_SDPA[a.graph_sdpa])
    engine = decoding_engine(
        a.pack,
        a.policy,
        a.device,
        a.max_bits,
        a.prompt_len,
        13 * a.steps + 8,
        not a.eager,
        a.seqs,
        not a.no_overlap,
        a.memory_budget,
    )
    decoding: set[int] = set()
    while len(decoding) < a.seqs:  # every prompt prefilled (chunks of max_batch_tokens)
        decoding |= {s.seq_id for s in engine.step()}
    graphs = engine.batcher.runner.graphs
    for _ in range(5):  # warm decode steps until a window of them captures no graph
        captured = graphs.captures if graphs is not None else 0
        for _ in range(a.steps):
            engine.step()
        if graphs is None or graphs.captures == captured:
            break
    # steps back to back, the GPU synced only around them: overlapped steps (batcher.py) keep
    # one step queued while the host prepares the next, so a synced step would hide that
    t = []
    for _ in range(3):
        t0 = synced(a.device)
        for _ in range(a.steps):
            engine.step()
        t.append((synced(a.device) - t0) / a.steps)
    t.sort()
    print("decode graphs:", "off (eager)" if graphs is None else graphs.stats())
    print(f"{a.policy} max-bits {a.max_bits}: decode step wall ms median {t[1] * 1e3:.2f}"
          f" min {t[0] * 1e3:.2f} max {t[-1] * 1e3:.2f} (3 runs of {a.steps} steps, mean a step;"
          f" overlap {'on' if engine.batcher.overlap else 'off'})")  # fmt: skip
    if a.device.startswith("cuda"):
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        captured = graphs.captures if graphs is not None else 0
        with torch.profiler.profile(activities=acts) as prof:
            t0 = synced(a.device)
            for _ in range(a.steps):
                engine.step()
            wall = synced(a.device) - t0
        busy, kernels = gpu_busy_us(prof)
        busy, median = busy / a.steps / 1e3, t[1] * 1e3  # ms a step
        print(f"profiled ({a.seqs} sequences): wall {wall / a.steps * 1e3:.2f} ms a step, GPU "
              f"busy {busy:.2f} ms a step ({busy / median:.0%} of the unprofiled median step), "
              f"{kernels / a.steps:.0f} GPU ops a step")  # fmt: skip
        if graphs is not None and graphs.captures > captured:  # eager kernels of a capture
            print(f"  ({graphs.captures - captured} graph captures in the profiled steps: their "
                  "eager runs count in the busy time)")  # fmt: skip
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
    host_outside_forward(engine, a.device, a.steps)
    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(a.steps):
        engine.step()
    synced(a.device)
    prof_py.disable()
    stats = pstats.Stats(prof_py)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats("pwctl", 25)  # the host work that is ours
    if a.device.startswith("cuda"):
        graph_alone(engine, a.steps)


if __name__ == "__main__":
    main()
