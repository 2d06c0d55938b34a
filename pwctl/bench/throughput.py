"""`pwctl bench PACK --throughput`: serving speed per policy, measured on the continuous-batching
engine itself (`Engine.start_batching` / `add_request` / `step`), so the figures are what
`pwctl serve` would do with the same policy, memory budget and batch settings.

Two loads: `--batch B` submits B requests at once; `--concurrency C --requests N` is a closed
loop that keeps C requests in flight until N have completed. Every request is an `input_len`-token
window of real text (the bundled eval sample by default) and generates exactly `output_len`
tokens, greedy, ignoring eos."""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.policy import Policy
from pwctl.runtime.accounting import SLACK, DevicePeak, over_budget
from pwctl.runtime.batcher import BatchConfig, Batcher
from pwctl.runtime.engine import Engine
from pwctl.runtime.scheduler import SamplingParams, Sequence
from pwctl.text import read_texts

DEFAULT_POLICIES = ["fp16", "uniform:4"]
# engine counters reported as their change over the measured run (warm-up excluded)
DELTAS = ("width_demotions", "width_promotions", "width_demoted_bytes", "width_promoted_bytes",
          "preemptions", "steps", "aborted")  # fmt: skip
# absent when eager; in ThroughputResult's order
GRAPH_COUNTS = ("decode_graph_captures", "decode_graph_capture_s", "decode_graph_replays")
ACCOUNTED = "engine accounting, fixed + planes + KV blocks in use"
WARMUP_PROMPT = 16  # warm-up request: prompt tokens (at most) ...
WARMUP_OUTPUT = 4  # ... and output tokens
GROWTH_MB = 64  # a rise of the reserved high-water mark the timeline records ...
MAX_GROWTH = 40  # ... at most this many times a run


@dataclass(frozen=True)
class ThroughputSpec:
    """What to run for every policy: each `batches` entry, then each `concurrency` entry."""

    input_len: int = 2048
    output_len: int = 256
    batches: tuple[int, ...] = ()
    concurrency: tuple[int, ...] = ()
    requests: int | None = None  # closed loop: completed requests (default 2 x concurrency)
    max_seqs: int | None = None  # running at once (default: the load, so all may run)
    max_batch_tokens: int = 256  # tokens per step (serve's default)
    memory_budget: str | None = None
    warmup: bool = True
    cuda_graphs: bool = True  # decode steps from CUDA graphs (paged experts on CUDA)

    def validate(self) -> None:
        """Raise PwctlError on settings that can never run (before the model loads)."""
        for name, value in (("--input-len", self.input_len), ("--output-len", self.output_len),
                            ("--max-batch-tokens", self.max_batch_tokens)):  # fmt: skip
            if value < 1:
                raise PwctlError(f"{name} {value}: must be at least 1")
        if not self.batches and not self.concurrency:
            raise PwctlError("bench --throughput: give --batch B ... and/or --concurrency C ...")
        bad = [b for b in self.batches if b < 1] + [c for c in self.concurrency if c < 1]
        if bad:
            raise PwctlError(f"--batch / --concurrency {bad[0]}: must be at least 1")
        if self.requests is not None and (self.requests < 1 or not self.concurrency):
            raise PwctlError("--requests N (N >= 1) goes with --concurrency C")
        if self.max_seqs is not None and self.max_seqs < 1:
            raise PwctlError(f"--max-seqs {self.max_seqs}: must be at least 1")

    def loads(self) -> list[tuple[str, int, int]]:
        """(mode, requests in flight, requests completed) of every run."""
        runs = [("batch", b, b) for b in self.batches]
        return runs + [("concurrency", c, self.requests or 2 * c) for c in self.concurrency]

    def batch_config(self, in_flight: int, n_requests: int) -> BatchConfig:
        return BatchConfig(
            max_seqs=self.max_seqs or in_flight,
            max_batch_tokens=self.max_batch_tokens,
            max_queue=max(64, n_requests),  # a batch is submitted whole: never QueueFull
            max_model_len=self.input_len + self.output_len,
            cuda_graphs=self.cuda_graphs,
        )


@dataclass
class ThroughputResult:
    policy: str
    mode: str  # "batch" or "concurrency"
    load: int  # B, or C
    requests: int
    input_len: int
    output_len: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    output_tok_s: float
    total_tok_s: float
    ttft_mean_s: float | None  # None only when every request was aborted
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tpot_mean_s: float | None  # None when output_len is 1 (no decode step)
    tpot_p90_s: float | None
    decode_tok_s: float | None  # 1 / tpot_mean: one sequence's decode speed
    peak_memory_bytes: int  # CUDA: DevicePeak.total (reserved + CuPy pool); CPU: accounted
    peak_memory_source: str  # "cuda reserved + cupy pool" or "accounted"
    peak_accounted_bytes: int  # fixed + planes + KV blocks in use, at the step it peaked
    peak_plane_bytes: int
    peak_kv_bytes: int
    memory_budget_bytes: int
    demotions: int
    promotions: int
    demoted_bytes: int
    promoted_bytes: int
    preemptions: int
    steps: int
    aborted: int
    requested_tokens: int = 0  # output tokens the requests asked for
    cut_short: int = 0  # requests that ended before their max_tokens (aborted included)
    peak_nvml_bytes: int | None = None  # NVML's figure for the process (context included)
    over_budget: bool = False  # peak past the memory budget + accounting.SLACK (CUDA)
    peak_growth: list | None = None  # CUDA: steps where the reserved high-water mark rose
    graph_captures: int = 0  # decode step graphs captured during the run (CUDA)
    graph_capture_s: float = 0.0  # host seconds those captures took (inside the run's time)
    graph_replays: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Timeline:
    """Per-request submit / first / last token times and the engine's peak memory accounting."""

    def __init__(self, batcher: Batcher, device: str):
        self.batcher, self.device = batcher, device
        self.submit: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.peak = self.peak_planes = self.peak_kv = 0
        # CUDA: the steps at which the allocator's reserved high-water mark rose (where a peak
        # past the budget comes from): step, running, prefill tokens so far, captures, MB
        self.growth: list[dict[str, float]] = []
        self._high = torch.cuda.max_memory_reserved() if device.startswith("cuda") else 0
        self.start = self.now()

    def now(self) -> float:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()  # time what the GPU did, not what was queued
        return time.perf_counter()

    def submitted(self, seq: Sequence, at: float) -> None:
        self.submit[seq.seq_id] = at

    def stepped(self, got: list[Sequence]) -> float:
        t = self.now()
        for seq in got:
            self.first.setdefault(seq.seq_id, t)
            self.last[seq.seq_id] = t
        self._account(got)
        self._track_growth()
        return t

    def _track_growth(self) -> None:
        if not self.device.startswith("cuda"):
            return
        high = torch.cuda.max_memory_reserved()
        if high > self._high + GROWTH_MB * 1e6 and len(self.growth) < MAX_GROWTH:
            b, graphs = self.batcher, self.batcher.runner.graphs
            self.growth.append({
                "step": b.counters.steps, "running": len(b.scheduler.running),
                "prompt_tokens": b.counters.prompt_tokens,
                "captures": graphs.captures if graphs is not None else 0,
                "reserved_mb": round(high / 1e6, 1),
                "grew_mb": round((high - self._high) / 1e6, 1),
            })  # fmt: skip
        self._high = max(self._high, high)

    def _account(self, got: list[Sequence]) -> None:
        mem = self.batcher.memory
        kv_bytes = kv_bytes_in_use(self.batcher, got)
        self.peak_planes = max(self.peak_planes, mem.planes)
        self.peak_kv = max(self.peak_kv, kv_bytes)
        self.peak = max(self.peak, mem.fixed + mem.planes + kv_bytes)


def kv_bytes_in_use(batcher: Batcher, got: list[Sequence]) -> int:
    """KV bytes a step held: the blocks in use, plus those of the sequences it finished (they
    gave their blocks back before the step returned)."""
    kv = batcher.kv
    blocks = kv.used + sum(kv.blocks_for(s.num_computed) for s in got if s.finished)
    return blocks * kv.block_bytes


def report(
    pack: Path, device: str, spec: ThroughputSpec, results: list[ThroughputResult]
) -> dict[str, Any]:
    """The --json document."""
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return {
        "pack": str(pack),
        "device": name,
        "spec": asdict(spec),
        "results": [r.as_dict() for r in results],
    }


def prompt_windows(tokenizer: Any, path: Path, n: int, length: int) -> list[list[int]]:
    """`n` different `length`-token windows of the text at `path` (wrapping around a short text)."""
    text = read_texts([path])
    ids: list[int] = tokenizer(text[: max(4096, 8 * n * length)]).input_ids
    if len(ids) < 2:
        raise PwctlError(f"{path}: too little text to build prompts")
    while len(ids) < n * length:
        ids = ids + ids
    stride = (len(ids) - length) // max(1, n - 1) if n > 1 else 0
    return [ids[i * stride : i * stride + length] for i in range(n)]


def run_throughput(
    engine: Engine, policies: list[Policy], spec: ThroughputSpec, data: Path
) -> list[ThroughputResult]:
    """Every policy at every load of `spec`, each on a fresh batcher and fresh policy state."""
    spec.validate()
    context = engine.model.config.max_position_embeddings
    if spec.input_len + spec.output_len > context:
        raise PwctlError(
            f"--input-len {spec.input_len} + --output-len {spec.output_len} exceeds the model's "
            f"context of {context} tokens"
        )
    most = max(n for _, _, n in spec.loads())
    prompts = prompt_windows(engine.tokenizer, data, most, spec.input_len)
    return [
        _run_one(engine, policy, spec, mode, load, prompts[:n])
        for policy in policies
        for mode, load, n in spec.loads()
    ]


def _run_one(
    engine: Engine, policy: Policy, spec: ThroughputSpec, mode: str, load: int,
    prompts: list[list[int]],
) -> ThroughputResult:  # fmt: skip
    batcher = fresh_batcher(
        engine, policy, spec.memory_budget, spec.batch_config(load, len(prompts))
    )
    if spec.warmup:
        _warm_up(batcher, prompts[0])
    params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True)
    before = batcher.metrics()
    timeline = _Timeline(batcher, engine.device)
    seqs = _closed_loop(batcher, timeline, prompts, params, load)
    top = engine.store.max_bits  # a cap below the pack's widest width names the row
    capped = top < engine.pack.manifest.max_bits and policy.name != "fp16"
    label = f"{policy} max-bits {top}" if capped else str(policy)
    if engine.device.startswith("cuda") and batcher.runner.graphs is None:
        label += " eager"  # decode steps launched op by op, not replayed from graphs
    return _result(label, mode, load, spec, seqs, timeline, before, batcher.metrics())


def fresh_batcher(engine: Engine, policy: Policy, budget: str | None, cfg: BatchConfig) -> Batcher:
    """Drop the previous run's KV cache before building the next (peak memory stays per run);
    budgeted policies start again from the profile, as a freshly started server would."""
    engine.batcher = None
    engine.reset_policies()
    gc.collect()
    DevicePeak.reset(engine.device)  # the peak covers start-up, warm-up and the run
    return engine.start_batching(policy, budget, cfg)


def _warm_up(batcher: Batcher, prompt: list[int]) -> None:
    """One short request first: lazy set-up (weight caches, kernel compilation, graph capture)
    is start-up cost, not serving speed."""
    batcher.run([prompt[:WARMUP_PROMPT]], SamplingParams(max_tokens=WARMUP_OUTPUT))


def _closed_loop(
    batcher: Batcher, timeline: _Timeline, prompts: list[list[int]], params: SamplingParams,
    in_flight: int,
) -> list[Sequence]:  # fmt: skip
    """Keep `in_flight` requests submitted until every prompt has run (a batch: all at once)."""
    seqs: list[Sequence] = []

    def submit(at: float) -> None:
        seq = batcher.add(prompts[len(seqs)], params)
        timeline.submitted(seq, at)
        seqs.append(seq)

    for _ in range(min(in_flight, len(prompts))):
        submit(timeline.start)
    while batcher.has_work:
        got = batcher.step()
        t = timeline.stepped(got)
        done = sum(s.finished for s in got)
        for _ in range(min(done, len(prompts) - len(seqs))):
            submit(t)
    return seqs


def _result(
    policy: str, mode: str, load: int, spec: ThroughputSpec, seqs: list[Sequence],
    tl: _Timeline, before: dict[str, Any], after: dict[str, Any],
) -> ThroughputResult:  # fmt: skip
    seconds = max(tl.now() - tl.start, 1e-9)
    out_tokens = sum(len(s.output_ids) for s in seqs)
    prompt_tokens = sum(len(s.prompt_ids) for s in seqs)
    ttft = np.array(
        [tl.first[s.seq_id] - tl.submit[s.seq_id] for s in seqs if s.seq_id in tl.first]
    )
    tpot = np.array([(tl.last[s.seq_id] - tl.first[s.seq_id]) / (len(s.output_ids) - 1)
                     for s in seqs if len(s.output_ids) > 1])  # fmt: skip
    peak, source, nvml = _peak_memory(tl)
    budget = after["memory_budget_bytes"]
    delta = {k: after[k] - before[k] for k in DELTAS}
    return ThroughputResult(
        policy, mode, load, len(seqs), spec.input_len, spec.output_len, prompt_tokens, out_tokens,
        seconds, out_tokens / seconds, (prompt_tokens + out_tokens) / seconds,
        _stat(ttft, "mean"), _stat(ttft, 50), _stat(ttft, 90), _stat(tpot, "mean"),
        _stat(tpot, 90), 1 / tpot.mean() if tpot.size and tpot.mean() > 0 else None,
        peak, source, tl.peak, tl.peak_planes, tl.peak_kv, budget,
        delta["width_demotions"], delta["width_promotions"], delta["width_demoted_bytes"],
        delta["width_promoted_bytes"], delta["preemptions"], delta["steps"],
        sum(s.finish_reason == "abort" for s in seqs),
        len(seqs) * spec.output_len, sum(len(s.output_ids) < spec.output_len for s in seqs),
        nvml, source != "accounted" and over_budget(peak, budget), tl.growth or None,
        *(after.get(k, 0) - before.get(k, 0) for k in GRAPH_COUNTS),
    )  # fmt: skip


def _stat(values: np.ndarray, which: str | int) -> float | None:
    """Mean or percentile; None without values (JSON has no NaN)."""
    if not values.size:
        return None
    return float(values.mean() if which == "mean" else np.percentile(values, which))


def _peak_memory(tl: _Timeline) -> tuple[int, str, int | None]:
    """CUDA: what the process really held (runtime/accounting.py's DevicePeak: the caching
    allocator's reserved high-water mark + CuPy's pool; NVML's figure beside it); CPU: the
    engine's own accounting (fixed weights and workspace + planes + KV blocks in use), since
    process RSS includes caches the GPU path would not hold."""
    if tl.device.startswith("cuda"):
        peak = DevicePeak.read(tl.device)
        return peak.total, "cuda reserved + cupy pool", peak.nvml
    return tl.peak, "accounted", None


def failures(results: list[ThroughputResult]) -> list[str]:
    """What makes a run fail: a request cut short, a peak past its budget (+ SLACK)."""
    out = []
    for r in results:
        load = f"{r.policy} {r.mode} {r.load}"
        if r.cut_short:
            got = r.output_tokens
            out.append(f"{load}: {r.cut_short} requests cut short ({got}/{r.requested_tokens})")
        if r.over_budget:
            out.append(
                f"{load}: peak {r.peak_memory_bytes / 1e6:.1f} MB is over the memory budget "
                f"{r.memory_budget_bytes / 1e6:.1f} MB + {SLACK:.0%}"
            )
    return out


def table(results: list[ThroughputResult]) -> tuple[str, tuple[str, ...], list[tuple]]:
    """(title, columns, rows) for print_table; load B1 = batch of 1, C2 = concurrency 2; TTFT
    mean/p50/p90, TPOT mean/p90; dem/pro = blocks demoted / promoted during the run; captures =
    decode graphs captured during the run / their seconds (inside the timed run: a fresh
    shape's first step pays one)."""
    columns = ("policy", "load", "req", "out tok/s", "all tok/s", "TTFT ms", "TPOT ms",
               "peak / budget MB", "done", "dem/pro", "preempt", "captures")  # fmt: skip
    rows = [
        (r.policy, f"{r.mode[0].upper()}{r.load}", r.requests, f"{r.output_tok_s:.1f}",
         f"{r.total_tok_s:.1f}", "/".join(_ms(t) for t in (r.ttft_mean_s, r.ttft_p50_s,
         r.ttft_p90_s)), f"{_ms(r.tpot_mean_s)}/{_ms(r.tpot_p90_s)}",
         f"{r.peak_memory_bytes / 1e6:.1f} / {r.memory_budget_bytes / 1e6:.1f}"
         + (" OVER" if r.over_budget else ""),
         f"{r.output_tokens}/{r.requested_tokens}", f"{r.demotions}/{r.promotions}", r.preemptions,
         f"{r.graph_captures}/{r.graph_capture_s:.2f}s" if r.graph_captures else "-")
        for r in results
    ]  # fmt: skip
    if not results:
        return "serving throughput", columns, rows
    r = results[0]
    src = ACCOUNTED if r.peak_memory_source == "accounted" else r.peak_memory_source
    title = (
        f"serving throughput, {r.input_len} in / {r.output_len} out per request (peak MB: {src})"
    )
    return title, columns, rows


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
