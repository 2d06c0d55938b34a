"""Memory budgets for serving benchmarks, in the engine's own accounting: the fixed part (non-expert
weights + workspace estimate of a BatchConfig) + the planes of a fixed policy + the KV cache of a
number of full sequences. Issue 7's settings are stated this way ("fp16 weights + the KV of 4
sequences of 2304 tokens"); this prints them as sizes `--memory-budget` and `pagedweight:` accept:

    python -m pwctl.bench.serving_budget PACK --planes fp16 --seqs 4 --tokens 2304 --max-seqs 32

Only the non-expert weights load (on the CPU), so it is quick even for a large pack."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pwctl.policy import parse_policy
from pwctl.runtime.batcher import BatchConfig
from pwctl.runtime.engine import Engine, open_pack
from pwctl.runtime.kv_cache import KVCache, KVLayout

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def plane_bytes(engine: Engine, policy: str) -> int:
    """Expert bytes (planes + tables) of a fixed policy: fp16 or uniform:B."""
    engine.store.apply(parse_policy(policy))
    return engine.store.expert_bytes()


def kv_bytes(engine: Engine, cfg: BatchConfig, seqs: int, tokens: int) -> int:
    """KV blocks of `seqs` sequences of `tokens` tokens each."""
    layout = KVLayout.from_config(engine.model.config, engine.dtype)
    per_seq = -(-tokens // cfg.block_size)
    return seqs * per_seq * KVCache.block_bytes_of(layout, cfg.block_size)


def serving_budget(engine: Engine, cfg: BatchConfig, planes: str, seqs: int, tokens: int) -> int:
    """fixed + planes of `planes` + KV of `seqs` x `tokens`: a `--memory-budget` in bytes."""
    return (
        engine.fixed_bytes(cfg) + plane_bytes(engine, planes) + kv_bytes(engine, cfg, seqs, tokens)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument(
        "--planes", default="fp16", help="fixed policy whose planes count (fp16, uniform:B)"
    )
    ap.add_argument("--seqs", type=int, default=4, help="sequences whose KV counts")
    ap.add_argument("--tokens", type=int, default=2304, help="tokens per sequence")
    ap.add_argument("--max-seqs", type=int, default=16, help="as bench --max-seqs (workspace)")
    ap.add_argument("--max-batch-tokens", type=int, default=256, help="as bench (workspace)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="the bench's dtype")
    ap.add_argument(
        "--what",
        choices=("budget", "planes"),
        default="budget",
        help="budget: the whole --memory-budget; planes: a pagedweight BUDGET",
    )
    a = ap.parse_args()
    engine = Engine(open_pack(a.pack), "cpu", DTYPES[a.dtype])
    cfg = BatchConfig(max_seqs=a.max_seqs, max_batch_tokens=a.max_batch_tokens)
    if a.what == "planes":
        print(f"{plane_bytes(engine, a.planes)}b")
    else:
        print(f"{serving_budget(engine, cfg, a.planes, a.seqs, a.tokens)}b")


if __name__ == "__main__":
    main()
