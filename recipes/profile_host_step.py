"""The host's share of a serving step: `Batcher.step` at N decoding sequences with the model's
forward replaced by a ready logits tensor, so what is timed is what the host does around a decode
graph's replay (scheduling, tokens in and out, text, the planner). Streamed requests detokenize
every step; whole ones (`stream=False`: bench, generate, a non-streamed HTTP response) once at the
end. Runs on any device (the CPU is enough). Usage:
  python3 recipes/profile_host_step.py PACK [--policy P] [--seqs N] [--steps S]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import SamplingParams


def host_ms(pack: Path, policy: str, seqs: int, steps: int, stream: bool) -> float:
    engine = Engine(Pack(pack))
    cfg = BatchConfig(max_seqs=seqs, max_batch_tokens=4096, max_model_len=2048)
    batcher = engine.start_batching(parse_policy(policy), None, cfg)
    ids = engine.tokenizer("The quick brown fox jumps over the lazy dog. " * 8).input_ids
    params = SamplingParams(max_tokens=steps + 100, ignore_eos=True, stream=stream)
    for _ in range(seqs):
        batcher.add(ids, params)
    for _ in range(3):  # the prompts' prefill, with the real forward
        batcher.step()
    vocab = engine.model.config.vocab_size
    batcher.runner.forward = lambda batch, fed=None: torch.zeros(sum(batch.sampling), vocab)
    for _ in range(20):
        batcher.step()
    start = time.perf_counter()
    for _ in range(steps):
        batcher.step()
    return 1e3 * (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pack", type=Path)
    ap.add_argument("--policy", default="uniform:4")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    for stream in (True, False, True, False):  # interleaved: the VM's noise falls on both
        ms = host_ms(a.pack, a.policy, a.seqs, a.steps, stream)
        kind = "streamed" if stream else "whole"
        print(f"{a.policy} {a.seqs} sequences, {kind}: host {ms:.3f} ms a step (forward stubbed)")


if __name__ == "__main__":
    main()
