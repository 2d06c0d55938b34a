"""pwctl bench: quality, memory and speed of policies on a pack, one mode a run. Each mode is a
module of pwctl/commands/bench_modes/ (`MODES`, the dispatch table); the parameters of its `run`
are the options it reads. Options of one mode sit under that mode's help panel, options of
several modes under the common one; an option of another mode than the one chosen is an error,
as two modes at once are."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any

import typer

from pwctl.commands.bench_modes import (
    kernels,
    longbench,
    planner,
    ppl,
    predictions,
    quantizer,
    results,
    synthetic,
    throughput,
)
from pwctl.commands.common import (
    CudaGraphs,
    Device,
    JsonOut,
    MaxBits,
    MemoryBudget,
    Policies,
    handles_errors,
)
from pwctl.errors import PwctlError

# the dispatch table: each mode as the errors and --help name it, and its module
MODES: dict[str, ModuleType] = {
    "--ppl": ppl,
    "--longbench": longbench,
    "--synthetic": synthetic,
    "--predictions FILE": predictions,
    "--throughput": throughput,
    "--kernels": kernels,
    "--quantizer": quantizer,
    "--planner": planner,
    "--results": results,
}
MODE_PANEL = "Modes (one a run)"
LONG = "--longbench / --synthetic"


def _mode(flag: str, help: str) -> Any:
    return typer.Option(flag, help=help, rich_help_panel=MODE_PANEL)


def _in(panel: str, help: str, *flags: str) -> Any:
    """An option of one mode, under that mode's help panel."""
    return typer.Option(*flags, help=help, rich_help_panel=panel)


@handles_errors
def run(
    ctx: typer.Context,
    pack: Annotated[Path | None, typer.Argument(help="pack folder")] = None,
    ppl: Annotated[bool, _mode("--ppl", "perplexity and KL to fp16")] = False,
    longbench: Annotated[bool, _mode("--longbench", "LongBench v1 from --data DIR")] = False,
    synthetic: Annotated[bool, _mode("--synthetic", "pass key / needle / kv")] = False,
    predictions: Annotated[
        Path | None,
        typer.Option(
            help="score LongBench predictions: jsonl or folder (no PACK)",
            rich_help_panel=MODE_PANEL,
        ),
    ] = None,
    throughput: Annotated[
        bool, _mode("--throughput", "serving speed on the batched engine")
    ] = False,
    kernels: Annotated[bool, _mode("--kernels", "kernel speed (GPU)")] = False,
    quantizer: Annotated[bool, _mode("--quantizer", "nested vs RTN g128")] = False,
    planner: Annotated[bool, _mode("--planner", "planner latency (CPU)")] = False,
    results: Annotated[
        bool, _mode("--results", "regenerate docs/RESULTS.md + results.png")
    ] = False,
    # --ppl
    rtn: Annotated[list[int] | None, _in("--ppl", "add RTN g128 at B bits")] = None,
    seq_len: Annotated[int, _in("--ppl", "tokens per window")] = 512,
    kv_peak: Annotated[
        float, _in("--ppl", "pressure trace, KV peak as a fraction of BUDGET")
    ] = 0.0,
    # --longbench / --synthetic
    paper_tasks: Annotated[
        bool, _in(LONG, "--longbench: the paper's three tasks", "--paper-tasks")
    ] = False,
    save_predictions: Annotated[
        Path | None, _in(LONG, "--longbench: FILE.jsonl, or DIR in LongBench's layout")
    ] = None,
    tasks: Annotated[list[str] | None, _in(LONG, "tasks")] = None,
    lengths: Annotated[list[int] | None, _in(LONG, "--synthetic: prompt tokens")] = None,
    depths: Annotated[list[float] | None, _in(LONG, "--synthetic: fact depths 0..1")] = None,
    examples: Annotated[
        int | None, _in(LONG, "examples per task (--synthetic: per length, default 10)")
    ] = None,
    # --throughput
    input_len: Annotated[int, _in("--throughput", "prompt tokens")] = 2048,
    output_len: Annotated[int, _in("--throughput", "output tokens")] = 256,
    batch: Annotated[list[int] | None, _in("--throughput", "requests submitted at once")] = None,
    concurrency: Annotated[list[int] | None, _in("--throughput", "requests kept in flight")] = None,
    requests: Annotated[
        int | None, _in("--throughput", "--concurrency: requests to complete (default 2 x C)")
    ] = None,
    warmup: Annotated[bool, _in("--throughput", "one short request first")] = True,
    load_kind: Annotated[
        str | None,
        _in(
            "--throughput",
            "'bursty': phases alternating --burst-short requests of input-len/4 in, "
            "output-len/2 out and --burst-long of input-len/output-len, each phase submitted "
            "once the previous one finished",
            "--load",
        ),
    ] = None,
    burst_phases: Annotated[
        int, _in("--throughput", "--load bursty: phases, short first (short, long, short...)")
    ] = 3,
    burst_short: Annotated[int, _in("--throughput", "--load bursty: requests a short phase")] = 4,
    burst_long: Annotated[int, _in("--throughput", "--load bursty: requests a long phase")] = 32,
    trace: Annotated[
        Path | None,
        _in(
            "--throughput",
            'JSONL of {"at": seconds after the start, "input_len": N, "output_len": M} requests',
        ),
    ] = None,
    quality_sample: Annotated[
        int,
        _in(
            "--throughput",
            "KL of the served next-token distribution to fp16 (a second pass, fp32) on N "
            "sampled decode steps",
        ),
    ] = 0,
    cuda_graphs: CudaGraphs = True,
    expert_parallel: Annotated[
        int,
        _in(
            "--throughput",
            "ranks sharing the experts, each serving its share of the requests (started here, "
            "or by torchrun; CPU only for now; --batch and --concurrency loads)",
        ),
    ] = 1,
    # --kernels
    shape: Annotated[list[str] | None, _in("--kernels", "layer shapes")] = None,
    width: Annotated[list[str] | None, _in("--kernels", "widths, or mixed")] = None,
    tokens: Annotated[list[int] | None, _in("--kernels", "tokens per call")] = None,
    # --quantizer
    rows: Annotated[int, _in("--quantizer", "matrix rows")] = 1024,
    cols: Annotated[int, _in("--quantizer", "matrix inputs")] = 4096,
    # several modes
    data: Annotated[Path | None, typer.Option(help="text file (default: bundled eval)")] = None,
    policy: Policies = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="PNG (plot extra): --longbench/--synthetic score vs memory; --throughput bits, "
            "KV bytes and tok/s over time"
        ),
    ] = None,
    max_seqs: Annotated[
        int | None, typer.Option(help="running at once (--throughput: the load; else 4)")
    ] = None,
    max_batch_tokens: Annotated[int, typer.Option(help="serving benches: tokens per step")] = 256,
    memory_budget: MemoryBudget = None,
    max_tokens: Annotated[int, typer.Option(help="--ppl / --results: tokens evaluated")] = 8192,
    max_bits: MaxBits = None,
    device: Device = "auto",
    json: JsonOut = None,
) -> None:
    """Measure quality, memory and speed of policies on a pack (or of the quantizer)."""
    # typer's converted values (a Path, not click's str), taken before any other local exists
    values = dict(locals())
    mode = MODES[_chosen_mode(ctx)]
    mode.run(**{name: values[name] for name in _options(mode)})


def _chosen_mode(ctx: typer.Context) -> str:
    """The one mode of this run; an error naming every mode for none, two, or an option of a
    mode other than the chosen one."""
    chosen = [m for m in MODES if ctx.params[_name(m)] not in (False, None)]
    if len(chosen) != 1:
        what = "choose a mode" if not chosen else f"one mode at a time, not {' and '.join(chosen)}"
        raise PwctlError(f"bench: {what}; modes: {', '.join(MODES)}")
    mode, flags = chosen[0], {_name(m) for m in MODES}
    for p in ctx.command.params:
        name = p.name or ""
        if p.param_type_name != "option" or name in flags or name in _options(MODES[mode]):
            continue
        source = ctx.get_parameter_source(name)  # typer's own click: its enum, by name
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            owners = " / ".join(m for m in MODES if name in _options(MODES[m]))
            raise PwctlError(
                f"bench {mode}: {p.opts[0]} is an option of {owners}, not of {mode}; "
                f"modes: {', '.join(MODES)}"
            )
    return mode


def _name(mode: str) -> str:
    """The parameter a mode's flag sets: '--predictions FILE' -> 'predictions'."""
    return mode.split()[0].removeprefix("--")


def _options(module: ModuleType) -> set[str]:
    """The options a mode reads: its `run`'s parameters."""
    return set(inspect.signature(module.run).parameters)
