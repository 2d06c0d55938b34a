"""bench --throughput: serving speed on the batched engine per policy (a batch at once, requests
kept in flight, bursty phases or a trace), memory against the budget, and optionally the served
quality against an fp16 reference pass."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pwctl.commands import checks
from pwctl.commands.bench_modes.shared import needs_pack, open_checked
from pwctl.commands.common import console, policy_or_auto, print_table, write_json
from pwctl.device import parse_device
from pwctl.errors import PwctlError
from pwctl.policy import parse_policy

if TYPE_CHECKING:
    from pwctl.bench.throughput import ThroughputResult, ThroughputSpec
    from pwctl.runtime.engine.engine import Engine


def run(
    pack: Path | None,
    data: Path | None,
    policy: list[str] | None,
    input_len: int,
    output_len: int,
    batch: list[int] | None,
    concurrency: list[int] | None,
    requests: int | None,
    max_seqs: int | None,
    max_batch_tokens: int,
    memory_budget: str | None,
    warmup: bool,
    load_kind: str | None,
    burst_phases: int,
    burst_short: int,
    burst_long: int,
    trace: Path | None,
    quality_sample: int,
    cuda_graphs: bool,
    plot: Path | None,
    max_bits: int | None,
    device: str,
    json: Path | None,
) -> None:
    device = parse_device(device)
    from pwctl.bench import throughput as tp
    from pwctl.bench.plotting import pyplot
    from pwctl.build.checkpoint import EVAL_SAMPLE

    other = concurrency or load_kind is not None or trace is not None
    spec = tp.ThroughputSpec(
        input_len, output_len, tuple(batch or (() if other else (1, 4))),
        tuple(concurrency or ()), requests, max_seqs, max_batch_tokens, memory_budget, warmup,
        cuda_graphs, load_kind, burst_phases, burst_short, burst_long,
        None if trace is None else str(trace), quality_sample,
    )  # fmt: skip
    spec.validate()
    pack = needs_pack("--throughput", pack)
    if plot is not None:
        pyplot()  # the extra is missing: say so before the runs
    policies = [policy_or_auto(p) for p in (policy or tp.DEFAULT_POLICIES)]
    context = checks.model_context(open_checked(pack, max_bits).manifest.config)
    if input_len + output_len > context:  # before the model loads
        raise PwctlError(
            f"--input-len {input_len} + --output-len {output_len} exceeds the model's "
            f"context of {context} tokens"
        )
    samples: list[Any] = []  # --quality-sample: each row's served log-probabilities
    results = _runs(pack, policies, spec, max_bits, device, data or EVAL_SAMPLE, samples)
    reference = _reference(pack, device, results, samples) if samples else None
    print_table(*tp.table(results))
    if plot is not None:
        tp.plot(results, plot)
        console.print(f"wrote {plot}")
    write_json(json, tp.report(pack, device, spec, results, reference))
    failed = tp.failures(results)
    if failed:
        raise PwctlError("; ".join(failed))


def _runs(
    pack: Path,
    policies: list[Any],
    spec: ThroughputSpec,
    max_bits: int | None,
    device: str,
    data: Path,
    samples: list[Any],
) -> list[ThroughputResult]:
    """Each policy's rows, one engine at a time (each run's peak is its own): on CUDA paged
    planes, or fp16 on the 16-bit experts."""
    from pwctl.bench import throughput as tp
    from pwctl.runtime.engine.engine import Engine, experts_for, open_pack, serving_dtype

    engine: Engine | None = None
    results: list[ThroughputResult] = []
    for p in policies:
        kind = experts_for(p, device)
        if engine is None or engine.experts != kind:
            engine = None  # one engine at a time: each run's peak is its own
            gc.collect()
            dtype = serving_dtype(device, kind)
            engine = Engine(open_pack(pack), device, dtype, kind, max_bits)
        if p is None:  # auto: chosen for the largest load's memory budget
            mode, load, n = max(spec.loads(), key=lambda r: r[1])
            p = engine.auto_policy(spec.memory_budget, spec.batch_config(load, n))
            console.print(f"--policy auto: {p} on {device}", highlight=False)
        results += tp.run_throughput(engine, [p], spec, data, samples)
    return results


def _reference(
    pack: Path, device: str, results: list[ThroughputResult], samples: list[Any]
) -> dict[str, Any]:
    """--quality-sample: the fp16 logits, the reference path in fp32, after every run (a second
    pass), on the bench's device: on a GPU the CPU pass over dozens of 2k-token sequences took
    minutes a row; the store path computes the same fp32 logits either way."""
    import torch

    from pwctl.bench import throughput as tp
    from pwctl.runtime.engine.engine import Engine, open_pack

    gc.collect()  # the last run's engine is gone: its peak is not the reference's
    start = time.perf_counter()
    ref = Engine(open_pack(pack), device, torch.float32, experts="store")
    ref.set_policy(parse_policy("fp16"))
    load_s = time.perf_counter() - start
    tp.score_quality(ref, samples)
    scored = sum(r.kl_seconds or 0 for r in results)
    console.print(
        f"served-quality reference (fp16 weights, fp32 on {device}): load {load_s:.1f} s,"
        f" scoring {scored:.1f} s", highlight=False,
    )  # fmt: skip
    return {"path": f"store engine on {device}, fp16 policy, fp32", "load_s": load_s,
            "scored_s": scored}  # fmt: skip
