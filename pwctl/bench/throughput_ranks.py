"""`bench --throughput --expert-parallel N`: each rank's share of a run. Every rank runs the same
`run_throughput` on its own engine (its own KV cache and memory budget: data-parallel
attention), serves the requests whose index is its rank modulo N (round-robin) and keeps its
share of the load in flight, stepping in lockstep with the others (a rank out of work joins
every exchange with no tokens). After each run rank 0 gathers every rank's row and reports them
combined: tokens and requests summed over the ranks, over the longest rank's seconds (the ranks
start together and the run ends when the last one is done), latencies over every request, and
the largest rank's peak memory against its own budget; each rank's row stays beside it with its
state at the run's end (plane and KV bytes, widths, width moves: rank_metrics) and the run's
exchange calls, bytes and seconds."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch.distributed as dist

from pwctl.bench.throughput import (
    LATENCY,
    ThroughputResult,
    ThroughputSpec,
    latency_fields,
    load_label,
    moves_per_1k,
)
from pwctl.errors import PwctlError
from pwctl.runtime.engine.batcher import Batcher
from pwctl.runtime.parallel.exchange import ExchangeStats
from pwctl.runtime.parallel.gather import gather_to_first
from pwctl.runtime.parallel.rank_metrics import rank_metrics
from pwctl.runtime.parallel.ranks import RankEngine

# a rank's row: these fields of its own ThroughputResult, then its rank_metrics
ROW_FIELDS = ("requests", "prompt_tokens", "output_tokens", "seconds", "output_tok_s",
              "peak_memory_bytes", "peak_accounted_bytes", "peak_plane_bytes", "peak_kv_bytes",
              "memory_budget_bytes", "over_budget", "requested_tokens", "cut_short", "aborted",
              "demotions", "promotions", "demoted_bytes", "promoted_bytes", "preemptions",
              "steps", "bits_mean", "bits_min", "bits_max")  # fmt: skip
SUMMED = ("requests", "prompt_tokens", "output_tokens", "requested_tokens", "cut_short",
          "aborted", "demotions", "promotions", "demoted_bytes", "promoted_bytes",
          "preemptions")  # fmt: skip
LARGEST = ("seconds", "peak_memory_bytes", "peak_accounted_bytes", "peak_plane_bytes",
           "peak_kv_bytes", "memory_budget_bytes", "steps")  # fmt: skip


def check_loads(spec: ThroughputSpec, ranks: int) -> None:
    """Raise PwctlError on what a run in step cannot share out over `ranks` (before any rank
    starts): arrival loads (bursty, trace) and --quality-sample are not built for it yet, and a
    concurrency below the ranks would leave a rank with requests but nothing in flight."""
    if spec.load is not None or spec.trace is not None:
        raise PwctlError("--expert-parallel runs --batch and --concurrency loads only")
    if spec.quality_sample:
        raise PwctlError("--quality-sample does not run with --expert-parallel yet")
    small = [c for c in spec.concurrency if c < ranks]
    if small:
        raise PwctlError(
            f"--concurrency {small[0]} with --expert-parallel {ranks}: each rank keeps its "
            f"share in flight, so the concurrency needs at least {ranks}"
        )


class RankShare:
    """This rank's part of every run: `engine` steps it with the others."""

    def __init__(self, engine: RankEngine):
        self.engine = engine
        self.rank, self.world = dist.get_rank(engine.group), dist.get_world_size(engine.group)
        self._before = ExchangeStats()

    def check(self, spec: ThroughputSpec) -> None:
        check_loads(spec, self.world)

    def share(self, prompts: list[list[int]]) -> list[list[int]]:
        """This rank's requests: every world-th from its rank on."""
        return prompts[self.rank :: self.world]

    def share_of(self, load: int) -> int:
        """This rank's part of `load` requests in flight (round-robin, as the requests)."""
        return len(range(self.rank, load, self.world))

    def start(self) -> None:
        """The measured run starts (warm-up done): its exchanges count from here."""
        self._before = replace(self.engine.exchange.stats)

    def combine(
        self, result: ThroughputResult, ttft: np.ndarray, tpot: np.ndarray, batcher: Batcher
    ) -> ThroughputResult:
        """Rank 0: every rank's row combined (`result` is rank 0's own); other ranks: their
        own `result`. A collective: every rank calls it after each run."""
        run = self.engine.exchange.stats.since(self._before)  # the measured run's exchanges
        # its own result's fields, then its state at the run's end and the run's exchanges
        row = {"rank": self.rank, **{k: getattr(result, k) for k in ROW_FIELDS},
               **rank_metrics(batcher, run)}  # fmt: skip
        got = gather_to_first((row, ttft.tolist(), tpot.tolist()))
        if got is None:
            return result
        rows = [r for r, _, _ in got]
        every_ttft = np.concatenate([np.asarray(t, dtype=np.float64) for _, t, _ in got])
        every_tpot = np.concatenate([np.asarray(t, dtype=np.float64) for _, _, t in got])
        return combined(result, rows, every_ttft, every_tpot)


def combined(
    first: ThroughputResult, rows: list[dict[str, Any]], ttft: np.ndarray, tpot: np.ndarray
) -> ThroughputResult:
    """One row for the ranks' `rows` (`first`: rank 0's result, which gives the rest); the
    timeline is rank 0's alone, so the combined row has none."""
    summed = {k: sum(r[k] for r in rows) for k in SUMMED}
    largest = {k: max(r[k] for r in rows) for k in LARGEST}
    seconds = max(largest["seconds"], 1e-9)
    tokens = summed["output_tokens"]
    bits = [r["bits_mean"] for r in rows if r["bits_mean"] is not None]
    out = replace(
        first,
        **summed,
        **largest,
        policy=f"{first.policy} x{len(rows)} ranks",
        output_tok_s=tokens / seconds,
        total_tok_s=(tokens + summed["prompt_tokens"]) / seconds,
        over_budget=any(r["over_budget"] for r in rows),
        moves_per_1k_tokens=moves_per_1k(summed["demotions"] + summed["promotions"], tokens),
        bits_mean=float(np.mean(bits)) if bits else None,
        bits_min=min((r["bits_min"] for r in rows if r["bits_min"] is not None), default=None),
        bits_max=max((r["bits_max"] for r in rows if r["bits_max"] is not None), default=None),
        timeline=None,
        peak_growth=None,
        ranks=rows,
    )
    for name, value in zip(LATENCY, latency_fields(ttft, tpot), strict=True):
        setattr(out, name, value)
    return out


def rank_table(results: list[ThroughputResult]) -> tuple[str, tuple[str, ...], list[tuple]]:
    """(title, columns, rows) for print_table: each rank's row of every combined result."""
    columns = ("policy", "load", "rank", "req", "out tok", "out tok/s", "peak / budget MB",
               "exchanges", "sent MB", "exchange s")  # fmt: skip
    rows = [
        (r.policy, load_label(r.mode, r.load), row["rank"], row["requests"],
         row["output_tokens"], f"{row['output_tok_s']:.1f}",
         f"{row['peak_memory_bytes'] / 1e6:.1f} / {row['memory_budget_bytes'] / 1e6:.1f}",
         row["exchange"]["calls"], f"{row['exchange']['sent_bytes'] / 1e6:.2f}",
         f"{row['exchange']['seconds']:.3f}")
        for r in results
        for row in r.ranks or []
    ]  # fmt: skip
    return "expert-parallel ranks (each its own requests, KV cache and budget)", columns, rows
