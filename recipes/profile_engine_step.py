"""Where one decode step of the serving engine goes: wall time a step (one sequence, GPU synced
after each step), the GPU's busy time in the same steps (torch.profiler, kernel time summed), and
cProfile's top functions. The engine steps eagerly, so wall time past the GPU's is host time.
Usage (GPU machine; any pack, e.g. the bundled one after `pwctl convert tiny-mixtral PACK`):
  python3 recipes/profile_engine_step.py PACK POLICY [STEPS] [--max-bits B] [--device cuda]"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from pwctl.checkpoint import EVAL_SAMPLE
from pwctl.policy import parse_policy
from pwctl.runtime.batcher import BatchConfig
from pwctl.runtime.engine import Engine, experts_for, open_pack, serving_dtype
from pwctl.runtime.scheduler import SamplingParams
from pwctl.text import read_texts


def synced(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pack")
    ap.add_argument("policy")
    ap.add_argument("steps", type=int, nargs="?", default=32)
    ap.add_argument("--max-bits", type=int)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=256)
    a = ap.parse_args()
    policy = parse_policy(a.policy)
    experts = experts_for(policy, a.device)
    engine = Engine(open_pack(a.pack), a.device, serving_dtype(a.device), experts, a.max_bits)
    engine.start_batching(policy, None, BatchConfig(max_seqs=1))
    ids = engine.tokenizer(read_texts([EVAL_SAMPLE])[:20000]).input_ids[: a.prompt_len]
    engine.add_request(ids, SamplingParams(max_tokens=4 * a.steps + 8, ignore_eos=True))
    for _ in range(a.steps):  # prefill, then warm decode steps
        engine.step()
    t = []
    for _ in range(a.steps):
        t0 = synced(a.device)
        engine.step()
        t.append(synced(a.device) - t0)
    t.sort()
    print(f"{a.policy} max-bits {a.max_bits}: decode step wall ms median {t[len(t) // 2] * 1e3:.2f}"
          f" min {t[0] * 1e3:.2f} max {t[-1] * 1e3:.2f} over {a.steps}")  # fmt: skip
    if a.device.startswith("cuda"):
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            t0 = synced(a.device)
            for _ in range(a.steps):
                engine.step()
            wall = synced(a.device) - t0
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / a.steps
        launches = sum(e.count for e in events if e.self_device_time_total > 0) / a.steps
        print(f"profiled: wall {wall / a.steps * 1e3:.2f} ms a step, GPU kernels {gpu / 1e3:.2f} ms"
              f" a step, {launches:.0f} GPU ops a step")  # fmt: skip
        print(events.table(sort_by="self_device_time_total", row_limit=12))
    prof_py = cProfile.Profile()
    prof_py.enable()
    for _ in range(a.steps):
        engine.step()
    synced(a.device)
    prof_py.disable()
    stats = pstats.Stats(prof_py)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
