"""What a decode step in a CUDA graph would take (a probe for docs/PERF.md, nothing of it is in
the engine): one sequence is prefilled and decoded eagerly on the serving engine, then the model
forward of one more decode step (its token, position, cache rows and MoE calls fixed) is timed
eagerly (synced each call) and replayed from a CUDA graph. The replay is the GPU's time alone.
Usage (GPU machine): python3 recipes/perf_step_graph.py PACK [POLICY] [--max-bits B]"""

from __future__ import annotations

import argparse
import time

import torch
from profile_engine_step import decoding_engine

from pwctl.bench.kernels import _event_time, capture_graph
from pwctl.runtime.attention import ATTN_NAME, attention_implementation


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pack")
    ap.add_argument("policy", nargs="?", default="uniform:4")
    ap.add_argument("--max-bits", type=int)
    ap.add_argument("--prompt-len", type=int, default=256)
    a = ap.parse_args()
    engine = decoding_engine(a.pack, a.policy, "cuda", a.max_bits, a.prompt_len, 64)
    batcher = engine.batcher
    for _ in range(8):
        engine.step()
    batch = batcher.scheduler.schedule()  # the next decode step, run by hand below
    runner = batcher.runner
    inputs, pos, paged = runner.inputs(batch)
    keep = torch.tensor([inputs.shape[1] - 1], device="cuda")

    def forward() -> torch.Tensor:
        with attention_implementation(engine.model, ATTN_NAME), torch.no_grad():
            out = engine.model(
                input_ids=inputs, position_ids=pos, use_cache=False,
                logits_to_keep=keep, pwctl_batch=paged,
            )  # fmt: skip
        return out.logits

    eager = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        eager.append(time.perf_counter() - t0)
    eager.sort()
    print(f"{a.policy}: eager forward of one decode step {eager[10] * 1e3:.2f} ms (median of 20)")
    try:
        graph = capture_graph(forward)
    except Exception as e:  # a sync or a host read inside the forward: say which
        print(f"capture failed: {type(e).__name__}: {e}")
        return
    replay = _event_time(graph.replay, 50)
    print(f"{a.policy}: the same step replayed from a CUDA graph {replay * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
