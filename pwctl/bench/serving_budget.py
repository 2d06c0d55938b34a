"""Memory budgets for serving, in the engine's own accounting (memory/accounting.py): the fixed
part (non-expert weights + the workspace of the largest step) + the experts of a fixed policy +
the KV cache of a number of full sequences. Settings such as "fp16 weights + the KV of 4
sequences of 2304 tokens" are stated this way; this prints them as sizes `--memory-budget` and
`pagedweight:` accept:

    python -m pwctl.bench.serving_budget PACK --planes fp16 --seqs 4 --tokens 2304 --max-seqs 32

`--device cuda` counts as the engine does there: bit-plane policies on the paged backend (planes
and KV blocks in whole slabs of its arena), fp16 on the 16-bit experts
(bf16, KV blocks of their own). Only the non-expert weights load (on the CPU), so it is quick
even for a large pack, and no GPU is needed to compute a GPU budget. The sequences' length is
also the engine's `--max-model-len` (as bench --throughput sets it: input + output). With
`--measure` (on the GPU machine) the fixed part is the engine's own, confirmed by the largest
step it runs at start-up (docs/decisions/043-start-up-confirms-the-workspace.md)."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.engine import Engine, experts_for, open_pack, serving_dtype
from pwctl.runtime.memory.accounting import StepShape, fixed_part
from pwctl.runtime.memory.kv_cache import KVCache, KVLayout
from pwctl.runtime.memory.page_table import PageTable


class BudgetCalculator:
    """The engine's accounting of a pack on `device`, without its experts on any device unless
    `measure`: then the fixed part is the engine's own on `device`, confirmed by its start-up
    step (runtime/memory/accounting.py; a GPU is needed, and the formula stands where it measures
    nothing, e.g. on the CPU)."""

    def __init__(
        self,
        pack: Pack,
        device: str = "cuda",
        dtype: torch.dtype | None = None,
        measure: bool = False,
    ):
        self.pack, self.device = pack, device
        self.dtype, self.measure = dtype, measure
        self._engine: Engine | None = None
        self._table: PageTable | None = None

    def experts(self, planes: str) -> str:
        return experts_for(parse_policy(planes), self.device)

    def engine(self) -> Engine:
        """The model around the experts, on the CPU (only its shapes and weights count)."""
        if self._engine is None:  # fp16 and bf16 weights take the same bytes
            self._engine = Engine(self.pack, "cpu", self.dtype or serving_dtype(self.device))
        return self._engine

    def table(self) -> PageTable:
        if self._table is None:
            self._table = PageTable.from_pack(self.pack, 0)
        return self._table

    def plane_bytes(self, planes: str) -> int:
        """Device bytes of a fixed policy's experts (fp16 or uniform:B) as its backend counts."""
        policy = parse_policy(planes)
        store = self.engine().store
        store.apply(policy)
        if self.experts(planes) != "paged":
            return store.expert_bytes()
        return int(self.table().cost_of(store.widths).sum())

    def block_bytes(self, planes: str, cfg: BatchConfig) -> int:
        engine = self.engine()
        dtype = self.serving_dtype(planes)
        layout = KVLayout.from_config(engine.model.config, dtype)
        slab = self.table().slab_bytes if self.experts(planes) == "paged" else None
        return KVCache.block_bytes_of(layout, cfg.block_size, slab)

    def serving_dtype(self, planes: str) -> torch.dtype:
        return self.dtype or serving_dtype(self.device, self.experts(planes))

    def fixed_bytes(self, planes: str, cfg: BatchConfig) -> int:
        if self.measure:
            return self._engine_fixed(planes, cfg)
        engine = self.engine()
        step = StepShape(cfg.max_seqs, cfg.max_batch_tokens, engine.max_len(cfg), cfg.block_size)
        dtype = self.serving_dtype(planes)
        graphs = cfg.cuda_graphs and self.device.startswith("cuda")
        spec = self.pack.manifest.spec
        return fixed_part(engine.model, spec, dtype, step, graphs).total

    def _engine_fixed(self, planes: str, cfg: BatchConfig) -> int:
        """The serving engine's fixed part for `planes` and `cfg`, after its start-up on
        `device` (its default budget: the widest planes and `cfg.max_seqs` full sequences)."""
        experts = self.experts(planes)
        engine = Engine(self.pack, self.device, self.serving_dtype(planes), experts)
        engine.start_batching(parse_policy(planes), None, cfg)
        fixed = engine.fixed_bytes(cfg)
        del engine
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        return fixed

    def budget(self, planes: str, cfg: BatchConfig, seqs: int, tokens: int) -> int:
        """fixed + planes of `planes` + the KV of `seqs` x `tokens`: a `--memory-budget`."""
        kv = seqs * -(-tokens // cfg.block_size) * self.block_bytes(planes, cfg)
        slab = self.table().slab_bytes if self.experts(planes) == "paged" else 0
        return self.fixed_bytes(planes, cfg) + self.plane_bytes(planes) + kv + slab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("pack", type=Path)
    ap.add_argument(
        "--planes", default="fp16", help="fixed policy whose experts count (fp16, uniform:B)"
    )
    ap.add_argument("--seqs", type=int, default=4, help="sequences whose KV counts")
    ap.add_argument("--tokens", type=int, default=2304, help="tokens per sequence")
    ap.add_argument("--max-seqs", type=int, default=16, help="as bench --max-seqs (workspace)")
    ap.add_argument("--max-batch-tokens", type=int, default=256, help="as bench (workspace)")
    ap.add_argument("--device", default="cuda", help="the device whose engine counts (cuda, cpu)")
    ap.add_argument(
        "--measure",
        action="store_true",
        help="on the device: the engine's fixed part confirmed by its start-up step",
    )
    ap.add_argument(
        "--what",
        choices=("budget", "planes"),
        default="budget",
        help="budget: the whole --memory-budget; planes: a pagedweight BUDGET",
    )
    a = ap.parse_args()
    calc = BudgetCalculator(open_pack(a.pack), a.device, measure=a.measure)
    cfg = BatchConfig(
        max_seqs=a.max_seqs, max_batch_tokens=a.max_batch_tokens, max_model_len=a.tokens
    )
    if a.what == "planes":
        print(f"{calc.plane_bytes(a.planes)}b")
    else:
        print(f"{calc.budget(a.planes, cfg, a.seqs, a.tokens)}b")


if __name__ == "__main__":
    main()
