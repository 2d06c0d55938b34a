"""pwctl bench PACK --ppl / --longbench / --synthetic, bench --predictions FILE: quality and
memory per policy (more modes land with later issues)."""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from pwctl.commands import checks
from pwctl.commands.common import (
    CudaGraphs,
    console,
    err_console,
    handles_errors,
    policy_or_auto,
    print_ppl,
    print_table,
    write_json,
)
from pwctl.device import CHOICES, parse_device
from pwctl.errors import PwctlError
from pwctl.policy import parse_policy

DEFAULT_POLICIES = ["fp16", "uniform:8", "uniform:4", "uniform:3", "uniform:2"]
MODES = ("--ppl", "--longbench", "--synthetic", "--predictions FILE", "--throughput",
         "--kernels", "--quantizer", "--planner", "--results")  # fmt: skip


@handles_errors
def run(
    pack: Annotated[Path | None, typer.Argument(help="pack folder")] = None,
    ppl: Annotated[bool, typer.Option("--ppl", help="perplexity and KL to fp16")] = False,
    kernels: Annotated[bool, typer.Option("--kernels", help="kernel speed (GPU)")] = False,
    longbench: Annotated[
        bool, typer.Option("--longbench", help="LongBench v1 from --data DIR")
    ] = False,
    synthetic: Annotated[bool, typer.Option("--synthetic", help="pass key / needle / kv")] = False,
    predictions: Annotated[
        Path | None, typer.Option(help="score LongBench predictions: jsonl or folder (no PACK)")
    ] = None,
    paper_tasks: Annotated[
        bool, typer.Option("--paper-tasks", help="--longbench: the paper's three tasks")
    ] = False,
    save_predictions: Annotated[
        Path | None, typer.Option(help="--longbench: FILE.jsonl, or DIR in LongBench's layout")
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="PNG (plot extra): --longbench/--synthetic score vs memory; --throughput bits, "
            "KV bytes and tok/s over time"
        ),
    ] = None,
    tasks: Annotated[list[str] | None, typer.Option(help="--longbench/--synthetic tasks")] = None,
    lengths: Annotated[list[int] | None, typer.Option(help="--synthetic prompt tokens")] = None,
    depths: Annotated[list[float] | None, typer.Option(help="--synthetic fact depths 0..1")] = None,
    examples: Annotated[
        int | None, typer.Option(help="examples per task (--synthetic: per length, default 10)")
    ] = None,
    throughput: Annotated[
        bool, typer.Option("--throughput", help="serving speed on the batched engine")
    ] = False,
    input_len: Annotated[int, typer.Option(help="--throughput: prompt tokens")] = 2048,
    output_len: Annotated[int, typer.Option(help="--throughput: output tokens")] = 256,
    batch: Annotated[
        list[int] | None, typer.Option(help="--throughput: requests submitted at once")
    ] = None,
    concurrency: Annotated[
        list[int] | None, typer.Option(help="--throughput: requests kept in flight")
    ] = None,
    requests: Annotated[
        int | None, typer.Option(help="--concurrency: requests to complete (default 2 x C)")
    ] = None,
    max_seqs: Annotated[
        int | None, typer.Option(help="running at once (--throughput: the load; else 4)")
    ] = None,
    max_batch_tokens: Annotated[int, typer.Option(help="--throughput: tokens per step")] = 256,
    memory_budget: Annotated[
        str | None, typer.Option(help="planes + KV + workspace, as in serve (serving benches)")
    ] = None,
    warmup: Annotated[bool, typer.Option(help="--throughput: one short request first")] = True,
    load_kind: Annotated[
        str | None,
        typer.Option(
            "--load",
            help="--throughput: 'bursty': phases alternating --burst-short requests of "
            "input-len/4 in, output-len/2 out and --burst-long of input-len/output-len, each "
            "phase submitted once the previous one finished",
        ),
    ] = None,
    burst_phases: Annotated[
        int, typer.Option(help="--load bursty: phases, short first (short, long, short...)")
    ] = 3,
    burst_short: Annotated[int, typer.Option(help="--load bursty: requests a short phase")] = 4,
    burst_long: Annotated[int, typer.Option(help="--load bursty: requests a long phase")] = 32,
    trace: Annotated[
        Path | None,
        typer.Option(
            help='--throughput: JSONL of {"at": seconds after the start, "input_len": N, '
            '"output_len": M} requests'
        ),
    ] = None,
    quality_sample: Annotated[
        int,
        typer.Option(
            help="--throughput: KL of the served next-token distribution to fp16 (CPU "
            "reference, a second pass) on N sampled decode steps"
        ),
    ] = 0,
    cuda_graphs: CudaGraphs = True,
    quantizer: Annotated[bool, typer.Option("--quantizer", help="nested vs RTN g128")] = False,
    planner: Annotated[bool, typer.Option("--planner", help="planner latency (CPU)")] = False,
    results: Annotated[
        bool, typer.Option("--results", help="regenerate docs/RESULTS.md + results.png")
    ] = False,
    shape: Annotated[list[str] | None, typer.Option(help="--kernels: layer shapes")] = None,
    width: Annotated[list[str] | None, typer.Option(help="--kernels: widths, or mixed")] = None,
    tokens: Annotated[list[int] | None, typer.Option(help="--kernels: tokens per call")] = None,
    rows: Annotated[int, typer.Option(help="--quantizer: matrix rows")] = 1024,
    cols: Annotated[int, typer.Option(help="--quantizer: matrix inputs")] = 4096,
    data: Annotated[Path | None, typer.Option(help="text file (default: bundled eval)")] = None,
    policy: Annotated[list[str] | None, typer.Option(help="repeatable")] = None,
    rtn: Annotated[list[int] | None, typer.Option(help="--ppl: add RTN g128 at B bits")] = None,
    seq_len: Annotated[int, typer.Option(help="tokens per window")] = 512,
    kv_peak: Annotated[
        float, typer.Option(help="--ppl: pressure trace, KV peak as a fraction of BUDGET")
    ] = 0.0,
    max_tokens: Annotated[int, typer.Option(help="tokens evaluated at most")] = 8192,
    max_bits: Annotated[
        int | None, typer.Option(help="widest width served (default: the pack's)")
    ] = None,
    device: Annotated[str, typer.Option(help=CHOICES)] = "auto",
    json: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """Measure quality, memory and speed of policies on a pack (or of the quantizer)."""
    on = (ppl, longbench, synthetic, predictions is not None, throughput, kernels, quantizer,
          planner, results)  # fmt: skip
    _one_mode([m for m, chosen in zip(MODES, on, strict=True) if chosen])
    checks.at_least("--seq-len", seq_len, 2)  # a window predicts its tokens after the first
    checks.at_least("--max-tokens", max_tokens, 1)
    checks.between("--kv-peak", kv_peak, 0, 1)
    checks.at_least("--examples", examples, 1)
    for n in lengths or []:
        checks.at_least("--lengths", n, 1)
    for d in depths or []:
        checks.between("--depths", d, 0, 1)
    for b in rtn or []:
        checks.between("--rtn", b, 1, 8)
    device = parse_device(device)
    import torch

    from pwctl.bench import longbench as lb
    from pwctl.bench import synthetic_tasks as syn
    from pwctl.bench.longctx import EnginePool, RunSpec, memory_table, plot_scores
    from pwctl.bench.planner import run_planner_bench
    from pwctl.bench.plotting import pyplot
    from pwctl.bench.ppl import run_ppl
    from pwctl.bench.quantizer import GROUP, add_rtn_variant, as_dicts, run_quantizer_bench
    from pwctl.build.checkpoint import EVAL_SAMPLE
    from pwctl.runtime.engine.engine import Engine, experts_for, open_pack, serving_dtype
    from pwctl.text import token_windows

    if results:
        from pwctl.bench.results import run_results

        out = Path("docs") if Path("docs").is_dir() else Path(".")
        run_results(["tiny-mixtral", "tiny-qwen-moe"], Path(tempfile.mkdtemp()), out, max_tokens)
        console.print(f"wrote {out / 'RESULTS.md'} and {out / 'results.png'}")
        return
    if planner:
        figures = run_planner_bench()
        print_table(
            "planner latency, Qwen3-MoE-sized table (48 x 128 x 3 blocks)",
            ("case", "value"),
            [(k, v) for k, v in figures.items() if isinstance(v, int | float)],
        )
        write_json(json, figures)
        return
    if quantizer:
        checks.at_least("--rows", rows, 1)
        if cols < GROUP or cols % GROUP:
            raise PwctlError(f"--cols {cols}: a multiple of {GROUP} (the RTN baseline's group)")
        results = run_quantizer_bench(rows, cols, device=device)
        print_table(
            f"quantizer on Student-t(5) weights {rows}x{cols}",
            ("scheme", "bits", "bits/weight", "weight MSE", "output err"),
            [(r.scheme, r.bits, r.bits_per_weight, r.weight_mse, r.output_err) for r in results],
        )
        write_json(
            json, {"rows": rows, "cols": cols, "device": device, "results": as_dicts(results)}
        )
        return
    if predictions is not None:
        results = lb.run_predictions(predictions)
        print_table(f"LongBench scores of {predictions.name}", *lb.table(results))
        write_json(
            json, {"predictions": str(predictions), "results": [r.as_dict() for r in results]}
        )
        return
    if longbench or synthetic:
        if pack is None:
            raise PwctlError("bench --longbench/--synthetic needs a PACK")
        if paper_tasks and tasks:
            raise PwctlError("--paper-tasks or --tasks, not both")
        policies = [parse_policy(p) for p in (policy or DEFAULT_POLICIES)]
        run_spec = RunSpec(memory_budget, max_seqs or RunSpec.max_seqs, max_batch_tokens)
        run_spec.validate()
        engines = EnginePool(_open(pack, max_bits), device, max_bits)  # serve's engine a policy
    if longbench:
        if data is None:
            raise PwctlError("bench --longbench needs --data DIR (LongBench's data folder)")
        chosen = lb.paper_tasks(data) if paper_tasks else tasks
        results = lb.run_longbench(engines, data, policies, chosen, examples, spec=run_spec)
        print_table(f"LongBench on {data} (score x100; examples)", *lb.table(results))
        points = lb.memory_points(results)
        print_table(*memory_table(points, "LongBench average"))
        if save_predictions is not None:
            saved = lb.save_predictions(results, save_predictions)
            console.print(f"wrote {len(saved)} prediction file(s) under {save_predictions}")
        if plot is not None:
            plot_scores(points, plot, "LongBench average score")
        write_json(json, lb.report(data, run_spec, results))
        return
    if synthetic:
        prose = data or EVAL_SAMPLE
        results = syn.run_synthetic(
            engines, policies, tasks or syn.TASKS, lengths or [256, 1024], examples or 10,
            depths=depths, prose_path=prose, spec=run_spec,
        )  # fmt: skip
        print_table(f"synthetic retrieval accuracy (prose: {prose.name})", *syn.table(results))
        points = syn.memory_points(results)
        print_table(*memory_table(points, "mean accuracy"))
        if plot is not None:
            plot_scores(points, plot, "synthetic retrieval accuracy")
        write_json(json, {"prose": str(prose), "results": [r.as_dict() for r in results]})
        return
    if kernels:
        from pwctl.bench import kernels as kb

        shapes, widths = shape or list(kb.SHAPES), width or ["2", "3", "4", "8", "mixed"]
        counts = tokens or [1, 2, 4, 8, 16, 512]
        kb.check_args(shapes, widths, counts)
        if not torch.cuda.is_available():
            raise PwctlError("bench --kernels needs a CUDA device")
        copy_bw, rows = kb.run_kernel_bench(
            shapes, widths, counts,
            on_row=lambda r: err_console.print("  ".join(kb.row_cells(r)), highlight=False),
        )  # fmt: skip
        name = torch.cuda.get_device_name()
        title = f"fused MoE layer, {name} (copy {copy_bw / 1e12:.2f} TB/s)"
        print_table(title, kb.ROW_COLUMNS, [kb.row_cells(r) for r in rows])
        against = kb.against_targets(rows)
        if against:
            print_table(
                "against the kernel targets (worst of the rows each covers)",
                kb.TARGET_COLUMNS,
                [kb.target_cells(c) for c in against],
            )
        else:  # e.g. only widths 5-8: say so rather than print an empty table
            names = "; ".join(t.name for t in kb.TARGETS)
            console.print(f"no kernel target covers these rows (targets: {names})")
        write_json(json, {"device": name, "copy_bytes_per_s": copy_bw,
                          "rows": [r.as_dict() for r in rows], "targets": against})  # fmt: skip
        return
    if throughput:
        import torch

        from pwctl.bench import throughput as tp

        other = concurrency or load_kind is not None or trace is not None
        spec = tp.ThroughputSpec(
            input_len, output_len, tuple(batch or (() if other else (1, 4))),
            tuple(concurrency or ()), requests, max_seqs, max_batch_tokens, memory_budget, warmup,
            cuda_graphs, load_kind, burst_phases, burst_short, burst_long,
            None if trace is None else str(trace), quality_sample,
        )  # fmt: skip
        spec.validate()
        if pack is None:
            raise PwctlError("bench --throughput needs a PACK")
        if plot is not None:
            pyplot()  # the extra is missing: say so before the runs
        policies = [policy_or_auto(p) for p in (policy or tp.DEFAULT_POLICIES)]
        context = checks.model_context(_open(pack, max_bits).manifest.config)
        if input_len + output_len > context:  # before the model loads
            raise PwctlError(
                f"--input-len {input_len} + --output-len {output_len} exceeds the model's "
                f"context of {context} tokens"
            )
        engine: Engine | None = None  # on CUDA: paged planes, or fp16 on the 16-bit experts
        results = []
        samples: list = []  # --quality-sample: each row's served log-probabilities
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
            results += tp.run_throughput(engine, [p], spec, data or EVAL_SAMPLE, samples)
        reference = None
        if samples:  # the fp16 logits: the reference path in fp32, after every run (a second pass)
            engine = None
            gc.collect()
            start = time.perf_counter()
            # on the bench's device: on a GPU the CPU pass over dozens of 2k-token sequences
            # took minutes a row; the store path computes the same fp32 logits either way
            ref = Engine(open_pack(pack), device, torch.float32, experts="store")
            ref.set_policy(parse_policy("fp16"))
            load_s = time.perf_counter() - start
            tp.score_quality(ref, samples)
            scored = sum(r.kl_seconds or 0 for r in results)
            reference = {"path": f"store engine on {device}, fp16 policy, fp32",
                         "load_s": load_s, "scored_s": scored}  # fmt: skip
            console.print(
                f"served-quality reference (fp16 weights, fp32 on {device}): load {load_s:.1f} s,"
                f" scoring {scored:.1f} s", highlight=False,
            )  # fmt: skip
        print_table(*tp.table(results))
        if plot is not None:
            tp.plot(results, plot)
            console.print(f"wrote {plot}")
        write_json(json, tp.report(pack, device, spec, results, reference))
        failed = tp.failures(results)
        if failed:
            raise PwctlError("; ".join(failed))
        return
    if pack is None:
        raise PwctlError("bench --ppl needs a PACK")
    policies = [parse_policy(p) for p in (policy or DEFAULT_POLICIES)]
    opened = _open(pack, max_bits)
    checks.between("--seq-len", seq_len, 2, checks.model_context(opened.manifest.config))
    data = data or EVAL_SAMPLE
    engine = Engine(opened, device, experts="store", max_bits=max_bits)  # reference math
    policies += [add_rtn_variant(engine, b) for b in rtn or []]
    results = run_ppl(
        engine, token_windows(engine.tokenizer, data, seq_len, max_tokens), policies, kv_peak
    )
    print_ppl(f"perplexity on {data.name} ({results[0].tokens} tokens)", results)
    write_json(json, {"data": str(data), "results": [r.as_dict() for r in results]})


def _one_mode(chosen: list[str]) -> None:
    if len(chosen) != 1:
        what = "choose a mode" if not chosen else f"one mode at a time, not {' and '.join(chosen)}"
        raise PwctlError(f"bench: {what}; modes: {', '.join(MODES)}")


def _open(pack: Path, max_bits: int | None):
    """The pack, its --max-bits checked against it (before the model loads)."""
    from pwctl.runtime.engine.engine import open_pack

    opened = open_pack(pack)
    checks.max_bits(max_bits, opened.manifest.min_bits, opened.manifest.max_bits)
    return opened
