"""bench --throughput: serving speed on the batched engine per policy (a batch at once, requests
kept in flight, bursty phases or a trace), memory against the budget, and optionally the served
quality against an fp16 reference pass. With --expert-parallel N every rank runs this same
function (started here, or by torchrun) and serves its share of the requests; rank 0 reports."""

from __future__ import annotations

import gc
import json as json_
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pwctl.commands import checks
from pwctl.commands.bench_modes.shared import needs_pack, open_checked
from pwctl.commands.common import console, policy_or_auto, print_table, write_json
from pwctl.device import parse_device
from pwctl.errors import PwctlError
from pwctl.policy import parse_policy

# the module a started rank runs (with the options `encode` gives), and the options that are
# paths (JSON has strings) or files only rank 0 writes
RANK_MODULE = "pwctl.commands.bench_modes.throughput_rank"
PATHS = ("pack", "data", "trace")
RANK_0_ONLY = ("json", "plot")

if TYPE_CHECKING:
    from pwctl.bench.throughput import ThroughputResult, ThroughputSpec
    from pwctl.bench.throughput_ranks import RankShare
    from pwctl.format.pack import Pack
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
    expert_parallel: int = 1,
) -> None:
    options = dict(locals())  # what a started rank runs this with (throughput_rank)
    checks.at_least("--expert-parallel", expert_parallel, 1)
    device = parse_device(device)
    if expert_parallel > 1:
        from pwctl.runtime.parallel.launch import rank_device

        device = rank_device(device, expert_parallel)
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
    if expert_parallel > 1:
        rank, results = _ranked_runs(options, pack, policies, spec, device, data or EVAL_SAMPLE)
        if rank != 0:  # rank 0 reports for every rank
            return
    else:
        results = _runs(pack, policies, spec, max_bits, device, data or EVAL_SAMPLE, samples)
    reference = _reference(pack, device, results, samples) if samples else None
    print_table(*tp.table(results))
    if expert_parallel > 1:
        from pwctl.bench.throughput_ranks import rank_table

        print_table(*rank_table(results))
    if plot is not None:
        tp.plot(results, plot)
        console.print(f"wrote {plot}")
    write_json(json, tp.report(pack, device, spec, results, reference))
    failed = tp.failures(results)
    if failed:
        raise PwctlError("; ".join(failed))


def _ranked_runs(
    options: dict[str, Any],
    pack: Path,
    policies: list[Any],
    spec: ThroughputSpec,
    device: str,
    data: Path,
) -> tuple[int, list[ThroughputResult]]:
    """--expert-parallel N: this process as a rank (rank 0 starts the others, each running this
    mode with the same options), its share of every run; (rank, rows: combined on rank 0)."""
    from pwctl.bench.throughput_ranks import check_loads
    from pwctl.runtime.parallel.launch import ranks

    n = options["expert_parallel"]
    check_loads(spec, n)  # before any rank starts
    with ranks(n, [encode(options)], RANK_MODULE, device=device) as rank:
        if rank != 0:
            console.quiet = True  # a rank's own process: rank 0 prints for all
        results = _runs(pack, policies, spec, options["max_bits"], device, data, [], parallel=True)
    return rank, results


def _runs(
    pack: Path,
    policies: list[Any],
    spec: ThroughputSpec,
    max_bits: int | None,
    device: str,
    data: Path,
    samples: list[Any],
    parallel: bool = False,
) -> list[ThroughputResult]:
    """Each policy's rows, one engine at a time (each run's peak is its own): on CUDA paged
    planes, or fp16 on the 16-bit experts. `parallel`: this process is one rank of the joined
    group; its engine exchanges its experts with the others and serves its share."""
    from pwctl.bench import throughput as tp
    from pwctl.runtime.engine.engine import Engine, experts_for, open_pack, serving_dtype

    engine: Engine | None = None
    share: RankShare | None = None
    results: list[ThroughputResult] = []
    for p in policies:
        kind = experts_for(p, device)
        if engine is None or engine.experts != kind:
            engine = share = None  # one engine at a time: each run's peak is its own
            gc.collect()
            dtype = serving_dtype(device, kind)
            opened = _rank_pack(open_pack(pack), p) if parallel else open_pack(pack)
            engine = Engine(opened, device, dtype, kind, max_bits)
            share = _share(engine) if parallel else None
        if p is None:  # auto: chosen for the largest load's memory budget
            mode, load, n = max(spec.loads(), key=lambda r: r[1])
            p = engine.auto_policy(spec.memory_budget, spec.batch_config(load, n))
            console.print(f"--policy auto: {p} on {device}", highlight=False)
        results += tp.run_throughput(engine, [p], spec, data, samples, share)
    return results


def _rank_pack(pack: Pack, policy: Any) -> Pack:
    """This rank's share of `pack` (its experts' planes only) in the joined group."""
    import torch.distributed as dist

    from pwctl.runtime.parallel.rank_pack import rank_pack

    return rank_pack(pack, dist.get_world_size(), dist.get_rank(), policy)


def _share(engine: Engine) -> RankShare:
    from pwctl.bench.throughput_ranks import RankShare
    from pwctl.runtime.parallel.ranks import RankEngine

    return RankShare(RankEngine(engine))


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


def encode(options: dict[str, Any]) -> str:
    """`run`'s options for a started rank, as one JSON argument (rank 0's files left out)."""
    kept = {k: v for k, v in options.items() if k not in RANK_0_ONLY}
    return json_.dumps({k: str(v) if isinstance(v, Path) else v for k, v in kept.items()})


def decode(text: str) -> dict[str, Any]:
    """What `encode` wrote, as `run`'s options again (paths as paths, no files to write)."""
    options = json_.loads(text)
    for k in PATHS:
        options[k] = None if options[k] is None else Path(options[k])
    return {**options, **dict.fromkeys(RANK_0_ONLY)}
