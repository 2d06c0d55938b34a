"""`pwctl bench PACK --throughput`: serving speed per policy, measured on the continuous-batching
engine itself (`Engine.start_batching` / `add_request` / `step`), so the figures are what
`pwctl serve` would do with the same policy, memory budget and batch settings.

Four loads: `--batch B` submits B requests at once; `--concurrency C --requests N` is a closed
loop that keeps C requests in flight until N have completed; `--load bursty` alternates phases of
a few short requests and many long ones, each phase submitted whole once the previous one has
finished; `--trace FILE` replays a JSONL of arrivals (`at` seconds after the run starts). Every
request is a window of real text (the bundled eval sample by default) and generates exactly its
output tokens, greedy, ignoring eos.

Beside speed, each run records the mean bits per weight of the widths plan at every step
(`store.widths` weighted by each block's weight count, rows x cols), the KV bytes in use and the
tokens generated (the timeline `--plot` draws), and moves (demotions + promotions) per 1,000
generated tokens. With `--quality-sample N` it keeps the served next-token log-probabilities of N
decode steps (reservoir-sampled, one decoding sequence each) and afterwards scores them against
the fp16 model: the CPU reference path (`Engine.logits` on a store engine in fp16 policy) runs once
over each sampled sequence's recorded tokens, and the report gives KL(fp16 || served) in nats and
the seconds that second pass took."""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from pwctl.bench.plotting import pyplot
from pwctl.errors import PwctlError
from pwctl.policy import Kind, Policy
from pwctl.runtime.engine.batcher import BatchConfig, Batcher
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import SamplingParams, Sequence
from pwctl.runtime.memory.accounting import SLACK, DevicePeak, over_budget, reserved_where
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
LOADS = ("bursty",)  # --load
SHORT_INPUT, SHORT_OUTPUT = 4, 2  # a bursty short request: input_len / 4 in, output_len / 2 out
TIMELINE_POINTS = 400  # the JSON keeps at most this many timeline samples a run
TRACE_KEYS = {"at", "input_len", "output_len"}
IDLE_S = 0.005  # a trace gap: the batcher idles, then sleeps at most this long
SERIES = ("t_s", "bits", "kv_bytes", "output_tokens")  # a run's timeline, one sample a step
# ThroughputResult's latency fields, in its order (`latency_fields` gives them)
LATENCY = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "tpot_mean_s", "tpot_p90_s", "decode_tok_s")


class Steps(Protocol):
    """What the closed loop drives: a Batcher, or under --expert-parallel a RankEngine (its
    `has_work` asks every rank, its `step` joins the others' exchanges when it has no work)."""

    @property
    def has_work(self) -> bool: ...

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence: ...

    def step(self) -> list[Sequence]: ...


class RankPart(Protocol):
    """This rank's part of every run under --expert-parallel (throughput_ranks.RankShare): its
    requests, the engine that steps it with the other ranks, and the gathering of the rows."""

    @property
    def engine(self) -> Steps: ...

    def check(self, spec: ThroughputSpec) -> None: ...

    def share(self, prompts: list[list[int]]) -> list[list[int]]: ...

    def share_of(self, load: int) -> int: ...

    def start(self) -> None: ...

    def combine(
        self, result: ThroughputResult, ttft: np.ndarray, tpot: np.ndarray, batcher: Batcher
    ) -> ThroughputResult: ...


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
    load: str | None = None  # "bursty": phases of short and long requests
    burst_phases: int = 3  # bursty: phases, short first (short, long, short, ...)
    burst_short: int = 4  # bursty: requests of a short phase
    burst_long: int = 32  # bursty: requests of a long phase (input_len / output_len)
    trace: str | None = None  # JSONL of {"at": s, "input_len": N, "output_len": M}
    quality_sample: int = 0  # decode steps scored against the fp16 model (0: none)

    def validate(self) -> None:
        """Raise PwctlError on settings that can never run (before the model loads)."""
        for name, value in (("--input-len", self.input_len), ("--output-len", self.output_len),
                            ("--max-batch-tokens", self.max_batch_tokens)):  # fmt: skip
            if value < 1:
                raise PwctlError(f"{name} {value}: must be at least 1")
        if not (self.batches or self.concurrency or self.load or self.trace):
            raise PwctlError(
                "bench --throughput: give --batch B ..., --concurrency C ..., --load bursty "
                "and/or --trace FILE"
            )
        if self.load is not None and self.load not in LOADS:
            raise PwctlError(f"--load {self.load}: choose from {', '.join(LOADS)}")
        for name, value in (("--burst-phases", self.burst_phases),
                            ("--burst-short", self.burst_short),
                            ("--burst-long", self.burst_long)):  # fmt: skip
            if value < 1:
                raise PwctlError(f"{name} {value}: must be at least 1")
        if self.quality_sample < 0:
            raise PwctlError(f"--quality-sample {self.quality_sample}: must be at least 0")
        if self.trace is not None:
            read_trace(Path(self.trace))
        bad = [b for b in self.batches if b < 1] + [c for c in self.concurrency if c < 1]
        if bad:
            raise PwctlError(f"--batch / --concurrency {bad[0]}: must be at least 1")
        if self.requests is not None and (self.requests < 1 or not self.concurrency):
            raise PwctlError("--requests N (N >= 1) goes with --concurrency C")
        if self.max_seqs is not None and self.max_seqs < 1:
            raise PwctlError(f"--max-seqs {self.max_seqs}: must be at least 1")

    def loads(self) -> list[tuple[str, int, int]]:
        """(mode, requests in flight, requests completed) of every run; bursty: in flight is
        its largest phase, trace: every request."""
        runs = [("batch", b, b) for b in self.batches]
        runs += [("concurrency", c, self.requests or 2 * c) for c in self.concurrency]
        for mode in ("bursty",) * (self.load == "bursty") + ("trace",) * (self.trace is not None):
            arrivals = self.arrivals(mode)
            most = max(sum(a.phase == p for a in arrivals) for p in {a.phase for a in arrivals})
            runs.append((mode, most, len(arrivals)))
        return runs

    def arrivals(self, mode: str) -> list[Arrival]:
        """The requests of a bursty or trace run, in arrival order."""
        if mode == "bursty":
            return bursty_arrivals(self)
        if mode == "trace" and self.trace is not None:
            return read_trace(Path(self.trace))
        raise ValueError(f"no arrivals for mode {mode}")

    def max_len(self) -> int:
        """The longest request (prompt + output) of any load."""
        lengths = [self.input_len + self.output_len]
        for mode in ("bursty",) * (self.load == "bursty") + ("trace",) * (self.trace is not None):
            lengths += [a.input_len + a.output_len for a in self.arrivals(mode)]
        return max(lengths)

    def batch_config(self, in_flight: int, n_requests: int) -> BatchConfig:
        return BatchConfig(
            max_seqs=self.max_seqs or in_flight,
            max_batch_tokens=self.max_batch_tokens,
            max_queue=max(64, n_requests),  # a batch is submitted whole: never QueueFull
            max_model_len=self.max_len(),
            cuda_graphs=self.cuda_graphs,
        )


@dataclass(frozen=True)
class Arrival:
    """One request of a bursty or trace load: submitted once `at` seconds of the run have passed
    and every request of an earlier `phase` has finished."""

    at: float
    input_len: int
    output_len: int
    phase: int = 0


def bursty_arrivals(spec: ThroughputSpec) -> list[Arrival]:
    """`burst_phases` phases, alternating short (first) and long: a short phase is `burst_short`
    requests of input_len / 4 in and output_len / 2 out (default 4 x 512 / 128), a long one
    `burst_long` requests of input_len / output_len (default 32 x 2048 / 256)."""
    short = (max(1, spec.input_len // SHORT_INPUT), max(1, spec.output_len // SHORT_OUTPUT))
    out: list[Arrival] = []
    for phase in range(spec.burst_phases):
        if phase % 2 == 0:
            n, (i, o) = spec.burst_short, short
        else:
            n, (i, o) = spec.burst_long, (spec.input_len, spec.output_len)
        out += [Arrival(0.0, i, o, phase) for _ in range(n)]
    return out


def read_trace(path: Path) -> list[Arrival]:
    """A JSONL trace: one `{"at": seconds, "input_len": N, "output_len": M}` object a line (blank
    lines skipped), sorted by `at`; a malformed line raises PwctlError naming it."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PwctlError(f"--trace {path}: cannot read it ({e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        out.append(_trace_line(line, f"--trace {path}:{n}"))
    if not out:
        raise PwctlError(f"--trace {path}: no requests")
    return sorted(out, key=lambda a: a.at)


def _trace_line(line: str, where: str) -> Arrival:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise PwctlError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict) or set(obj) != TRACE_KEYS:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise PwctlError(f"{where}: want the keys at, input_len, output_len; got {got}")
    at, n_in, n_out = obj["at"], obj["input_len"], obj["output_len"]
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at) or at < 0:
        raise PwctlError(f"{where}: at {at!r}: want seconds >= 0")
    for name, value in (("input_len", n_in), ("output_len", n_out)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PwctlError(f"{where}: {name} {value!r}: want an integer >= 1")
    return Arrival(float(at), n_in, n_out)


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
    moves_per_1k_tokens: float = 0.0  # (demotions + promotions) per 1,000 generated tokens
    bits_mean: float | None = None  # bits per weight of the widths plan, mean over the steps
    bits_min: float | None = None
    bits_max: float | None = None
    # per step (thinned to TIMELINE_POINTS): t_s, bits, kv_bytes, output_tokens (cumulative)
    timeline: dict[str, list[float]] | None = field(default=None, repr=False)
    kl_samples: int = 0  # --quality-sample: decode steps scored against the fp16 model
    kl_mean: float | None = None  # KL(fp16 || served), nats per sampled token
    kl_p90: float | None = None
    kl_max: float | None = None
    kl_seconds: float | None = None  # the reference pass over this row's samples
    # the engine's fixed part by part (accounting.FixedPart: weights, workspace parts, and on
    # CUDA the largest step as measured at start-up)
    fixed_parts: dict[str, int | None] | None = None
    # --expert-parallel: each rank's row (this row combines them: throughput_ranks.combined)
    ranks: list[dict[str, Any]] | None = None

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
        # past the budget comes from): step, running, prefill tokens so far, captures, MB; the
        # first entry is the mark start-up and warm-up left
        self.growth: list[dict[str, object]] = []
        self._high = 0  # the mark at the last entry: a creep of small rises adds up to one
        self._track_growth()
        store = batcher.memory.store
        self._widths = store.widths  # the plan, changed in place between steps
        self._weights = np.array([b.rows * b.cols for b in store.pack.blocks], dtype=np.float64)
        # one sample before the first step and one after each: seconds, bits, KV bytes, tokens
        self.series: dict[str, list[float]] = {k: [] for k in SERIES}
        self.tokens = 0
        self.start = self.now()
        self._sample(self.start, batcher.kv.used * batcher.kv.block_bytes)

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
        kv_bytes = self._account(got)
        self._track_growth()
        self.tokens += len(got)
        self._sample(t, kv_bytes)
        return t

    def bits(self) -> float:
        """Mean bits per weight of the widths plan (block widths weighted by rows x cols)."""
        return float(self._widths @ self._weights / self._weights.sum())

    def _sample(self, t: float, kv_bytes: int) -> None:
        for key, value in zip(SERIES, (t - self.start, self.bits(), kv_bytes, self.tokens),
                              strict=True):  # fmt: skip
            self.series[key].append(value)

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
                "max_allocated_mb": round(torch.cuda.max_memory_allocated() / 1e6, 1),
                "grew_mb": round((high - self._high) / 1e6, 1),
                "where": reserved_where(self.device),
            })  # fmt: skip
            self._high = high

    def _account(self, got: list[Sequence]) -> int:
        """The step's peaks; returns the KV bytes in use this step."""
        mem = self.batcher.memory
        kv_bytes = kv_bytes_in_use(self.batcher, got)
        self.peak_planes = max(self.peak_planes, mem.planes)
        self.peak_kv = max(self.peak_kv, kv_bytes)
        self.peak = max(self.peak, mem.fixed + mem.planes + kv_bytes)
        return kv_bytes


def kv_bytes_in_use(batcher: Batcher, got: list[Sequence]) -> int:
    """KV bytes a step held: the blocks in use, plus those of the sequences it finished (they
    gave their blocks back before the step returned)."""
    kv = batcher.kv
    blocks = kv.used + sum(kv.blocks_for(s.num_computed) for s in got if s.finished)
    return blocks * kv.block_bytes


def report(
    pack: Path, device: str, spec: ThroughputSpec, results: list[ThroughputResult],
    quality_reference: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The --json document (`quality_reference`: how the --quality-sample KL was scored and
    what that second pass cost)."""
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    out = {
        "pack": str(pack),
        "device": name,
        "spec": asdict(spec),
        "results": [r.as_dict() for r in results],
    }
    if quality_reference is not None:
        out["quality_reference"] = quality_reference
    return out


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
    engine: Engine, policies: list[Policy], spec: ThroughputSpec, data: Path,
    samples: list[tuple[ThroughputResult, QualitySamples]] | None = None,
    ranks: RankPart | None = None,
) -> list[ThroughputResult]:  # fmt: skip
    """Every policy at every load of `spec`, each on a fresh batcher and fresh policy state.
    With `spec.quality_sample`, each row's sampled served log-probabilities are appended to
    `samples` (score them with `score_quality` once every run is done). With `ranks` (every
    rank calls this alike) this rank serves its share of each run's requests, in step with the
    others, and rank 0's rows combine every rank's."""
    spec.validate()
    if ranks is not None:
        ranks.check(spec)
    context = engine.model.config.max_position_embeddings
    if spec.max_len() > context:
        longest = "a request of the load" if spec.max_len() > spec.input_len + spec.output_len \
            else f"--input-len {spec.input_len} + --output-len {spec.output_len}"  # fmt: skip
        raise PwctlError(f"{longest} exceeds the model's context of {context} tokens")
    most = max([n for mode, _, n in spec.loads() if mode in ("batch", "concurrency")] or [1])
    windows = prompt_windows(engine.tokenizer, data, most, spec.input_len)
    results = []
    for policy in policies:
        for mode, load, n in spec.loads():
            if mode in ("batch", "concurrency"):
                prompts = windows[:n]
                arrivals = [Arrival(0.0, spec.input_len, spec.output_len)] * n
            else:
                arrivals = spec.arrivals(mode)
                prompts = arrival_prompts(engine.tokenizer, data, arrivals)
            result, got = _run_one(engine, policy, spec, mode, load, prompts, arrivals, ranks)
            results.append(result)
            if samples is not None and spec.quality_sample:
                samples.append((result, got))
    return results


def arrival_prompts(tokenizer: Any, data: Path, arrivals: list[Arrival]) -> list[list[int]]:
    """A different text window for every arrival, of its input_len."""
    by_len: dict[int, list[list[int]]] = {}
    for n in sorted({a.input_len for a in arrivals}):
        count = sum(a.input_len == n for a in arrivals)
        by_len[n] = prompt_windows(tokenizer, data, count, n)
    return [by_len[a.input_len].pop(0) for a in arrivals]


def _run_one(
    engine: Engine, policy: Policy, spec: ThroughputSpec, mode: str, load: int,
    prompts: list[list[int]], arrivals: list[Arrival], ranks: RankPart | None = None,
) -> tuple[ThroughputResult, QualitySamples]:  # fmt: skip
    # this rank's requests (round-robin by index) and how many of them it keeps in flight
    mine, in_flight = (ranks.share(prompts), ranks.share_of(load)) if ranks else (prompts, load)
    cfg = spec.batch_config(max(1, in_flight), max(1, len(mine)))
    batcher = fresh_batcher(engine, policy, spec.memory_budget, cfg)
    steps: Steps = batcher if ranks is None else ranks.engine
    if spec.warmup:  # every rank warms up on the same prompt, in step
        _warm_up(steps, prompts[0])
    before = batcher.metrics()
    if ranks is not None:
        ranks.start()
    timeline = _Timeline(batcher, engine.device)
    with QualitySamples(batcher, spec.quality_sample) as got:
        if mode in ("batch", "concurrency"):
            params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, stream=False)
            seqs = _closed_loop(steps, timeline, mine, params, in_flight)
        else:
            seqs = _arrival_loop(batcher, timeline, prompts, arrivals)
    top = engine.store.max_bits  # a cap below the pack's widest width names the row
    capped = top < engine.pack.manifest.max_bits and policy.kind is not Kind.FP16
    label = f"{policy} max-bits {top}" if capped else str(policy)
    if engine.device.startswith("cuda") and batcher.runner.graphs is None:
        label += " eager"  # decode steps launched op by op, not replayed from graphs
    result = _result(label, mode, load, spec, seqs, timeline, before, batcher.metrics())
    fixed = engine.fixed_part(cfg)
    result.fixed_parts = {"weights": fixed.weights, **fixed.parts, "measured_step": fixed.measured}
    if ranks is not None:  # rank 0: every rank's row, combined
        result = ranks.combine(result, *latencies(seqs, timeline), batcher)
    return result, got


def fresh_batcher(engine: Engine, policy: Policy, budget: str | None, cfg: BatchConfig) -> Batcher:
    """Drop the previous run's KV cache before building the next (peak memory stays per run);
    budgeted policies start again from the profile, as a freshly started server would."""
    engine.batcher = None
    engine.reset_policies()
    gc.collect()
    DevicePeak.reset(engine.device)  # the peak covers start-up, warm-up and the run
    return engine.start_batching(policy, budget, cfg)


def _warm_up(steps: Steps, prompt: list[int]) -> None:
    """One short request first: lazy set-up (weight caches, kernel compilation, graph capture)
    is start-up cost, not serving speed."""
    steps.add(prompt[:WARMUP_PROMPT], SamplingParams(max_tokens=WARMUP_OUTPUT))
    while steps.has_work:
        steps.step()


def _closed_loop(
    steps: Steps, timeline: _Timeline, prompts: list[list[int]], params: SamplingParams,
    in_flight: int,
) -> list[Sequence]:  # fmt: skip
    """Keep `in_flight` requests submitted until every prompt has run (a batch: all at once)."""
    seqs: list[Sequence] = []

    def submit(at: float) -> None:
        seq = steps.add(prompts[len(seqs)], params)
        timeline.submitted(seq, at)
        seqs.append(seq)

    for _ in range(min(in_flight, len(prompts))):
        submit(timeline.start)
    while steps.has_work:
        got = steps.step()
        t = timeline.stepped(got)
        done = sum(s.finished for s in got)
        for _ in range(min(done, len(prompts) - len(seqs))):
            submit(t)
    return seqs


def _arrival_loop(
    batcher: Batcher, timeline: _Timeline, prompts: list[list[int]], arrivals: list[Arrival]
) -> list[Sequence]:
    """Submit each arrival once its time has come and every earlier phase has finished (its
    submit time, for TTFT: its `at`, or when its phase opened if later); while nothing runs and
    the next arrival is still ahead, the batcher idles as a server's would."""
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i].phase, arrivals[i].at))
    seqs: list[Sequence] = []
    phase_of: dict[int, int] = {}
    opened = {0: timeline.start}  # phase -> when its earlier phases had all finished
    t = timeline.start
    while order or batcher.has_work:
        while order:
            a = arrivals[order[0]]
            if a.phase not in opened:
                if any(not s.finished and phase_of[s.seq_id] < a.phase for s in seqs):
                    break
                opened[a.phase] = t
            if timeline.start + a.at > timeline.now():
                break
            seq = batcher.add(
                prompts[order.pop(0)],
                SamplingParams(max_tokens=a.output_len, ignore_eos=True, stream=False),
            )
            timeline.submitted(seq, max(timeline.start + a.at, opened[a.phase]))
            phase_of[seq.seq_id] = a.phase
            seqs.append(seq)
        if batcher.has_work:
            t = timeline.stepped(batcher.step())
        elif order:  # a gap in the trace
            batcher.idle()
            wait = timeline.start + arrivals[order[0]].at - timeline.now()
            time.sleep(min(max(wait, 0.0), IDLE_S))
    return seqs


def _result(
    policy: str, mode: str, load: int, spec: ThroughputSpec, seqs: list[Sequence],
    tl: _Timeline, before: dict[str, Any], after: dict[str, Any],
) -> ThroughputResult:  # fmt: skip
    seconds = max(tl.now() - tl.start, 1e-9)
    out_tokens = sum(len(s.output_ids) for s in seqs)
    prompt_tokens = sum(len(s.prompt_ids) for s in seqs)
    lat = latency_fields(*latencies(seqs, tl))
    peak, source, nvml = _peak_memory(tl)
    budget = after["memory_budget_bytes"]
    delta = {k: after[k] - before[k] for k in DELTAS}
    return ThroughputResult(  # type: ignore[call-arg]  # star-expanded: mypy cannot count them
        policy, mode, load, len(seqs), spec.input_len, spec.output_len, prompt_tokens, out_tokens,
        seconds, out_tokens / seconds, (prompt_tokens + out_tokens) / seconds, *lat,
        peak, source, tl.peak, tl.peak_planes, tl.peak_kv, budget,
        delta["width_demotions"], delta["width_promotions"], delta["width_demoted_bytes"],
        delta["width_promoted_bytes"], delta["preemptions"], delta["steps"],
        sum(s.finish_reason == "abort" for s in seqs),
        sum(s.params.max_tokens for s in seqs),
        sum(len(s.output_ids) < s.params.max_tokens for s in seqs),
        nvml, source != "accounted" and over_budget(peak, budget), tl.growth or None,
        *(after.get(k, 0) - before.get(k, 0) for k in GRAPH_COUNTS),
        moves_per_1k(delta["width_demotions"] + delta["width_promotions"], out_tokens),
        *_bits_stats(tl.series["bits"]), _thin(tl.series),
    )  # fmt: skip


def latencies(seqs: list[Sequence], tl: _Timeline) -> tuple[np.ndarray, np.ndarray]:
    """Each request's time to first token, and time per output token after it (requests of
    more than one output token)."""
    ttft = np.array(
        [tl.first[s.seq_id] - tl.submit[s.seq_id] for s in seqs if s.seq_id in tl.first]
    )
    tpot = np.array([(tl.last[s.seq_id] - tl.first[s.seq_id]) / (len(s.output_ids) - 1)
                     for s in seqs if len(s.output_ids) > 1])  # fmt: skip
    return ttft, tpot


def latency_fields(
    ttft: np.ndarray, tpot: np.ndarray
) -> tuple[float | None, float | None, float | None, float | None, float | None, float | None]:
    """ThroughputResult's LATENCY fields, in its order, from `latencies`."""
    decode = 1 / float(tpot.mean()) if tpot.size and tpot.mean() > 0 else None
    return (_stat(ttft, "mean"), _stat(ttft, 50), _stat(ttft, 90), _stat(tpot, "mean"),
            _stat(tpot, 90), decode)  # fmt: skip


def moves_per_1k(moves: int, tokens: int) -> float:
    """Width moves per 1,000 generated tokens (0 when nothing was generated)."""
    return 1000 * moves / tokens if tokens else 0.0


def _bits_stats(bits: list[float]) -> tuple[float | None, float | None, float | None]:
    """Mean, min and max over the steps (the sample before the first step included)."""
    if not bits:
        return None, None, None
    return float(np.mean(bits)), float(min(bits)), float(max(bits))


def _thin(series: dict[str, list[float]]) -> dict[str, list[float]]:
    """At most TIMELINE_POINTS evenly spaced samples (the last one kept)."""
    n = len(series["t_s"])
    keep = sorted(set(np.linspace(0, n - 1, min(n, TIMELINE_POINTS)).round().astype(int)))
    return {k: [round(float(v[i]), 6) for i in keep] for k, v in series.items()}


class QualitySamples:
    """While a run is on (a context manager), keep the served next-token log-probabilities of
    `n` decode steps: a reservoir sample over the steps that decode, one decoding sequence of
    each (chosen at random, seeded), with the position it predicts. It wraps the batcher's
    `runner.forward` for the run and restores it after (the runtime is unchanged); a kept step
    copies one row of logits to the host. `n` = 0 records nothing."""

    def __init__(self, batcher: Batcher, n: int, seed: int = 0):
        self.batcher, self.n = batcher, n
        self.rng = np.random.default_rng(seed)
        self.kept: list[tuple[Sequence, int, torch.Tensor]] = []  # seq, position, log-probs
        self.decode_steps = 0
        self._forward: Callable[..., torch.Tensor] | None = None

    def __enter__(self) -> QualitySamples:
        if self.n:
            runner = self.batcher.runner
            self._forward = runner.forward
            runner.forward = self._wrapped  # type: ignore[method-assign]  # on the instance only
        return self

    def __exit__(self, *exc: object) -> None:
        if self._forward is not None:
            del self.batcher.runner.forward
            self._forward = None

    def _wrapped(self, batch: Any, fed: Any = None) -> torch.Tensor:
        assert self._forward is not None  # set by __enter__
        logits = self._forward(batch, fed)
        # each sampling row's position: its logits predict the token after it
        rows = [(s, s.num_computed + n - 1)
                for s, n, on in zip(batch.seqs, batch.n_tokens, batch.sampling, strict=True)
                if on]  # fmt: skip
        decoding = [i for i, (s, pos) in enumerate(rows) if pos >= len(s.prompt_ids)]
        if decoding:
            self._offer(logits, rows, decoding)
        return logits

    def _offer(
        self, logits: torch.Tensor, seqs: list[tuple[Sequence, int]], rows: list[int]
    ) -> None:
        self.decode_steps += 1
        slot = len(self.kept) if len(self.kept) < self.n else self.rng.integers(self.decode_steps)
        if slot >= self.n:
            return
        row = rows[int(self.rng.integers(len(rows)))]
        seq, pos = seqs[row]
        lp = torch.log_softmax(logits[row].float(), -1).cpu()
        sample = (seq, pos, lp)
        if slot == len(self.kept):
            self.kept.append(sample)
        else:
            self.kept[int(slot)] = sample


def kl(ref_logprobs: torch.Tensor, served_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(ref || served) in nats over the last dimension, from log-probabilities."""
    return (ref_logprobs.exp() * (ref_logprobs - served_logprobs)).sum(-1)


def score_quality(
    reference: Engine, samples: list[tuple[ThroughputResult, QualitySamples]]
) -> None:
    """Fill each row's kl_* fields: the reference engine (the CPU store path in fp16 policy)
    runs once over each sampled sequence's recorded tokens, up to its last sampled position;
    kl_seconds is that pass's time for the row."""
    for result, got in samples:
        start = time.perf_counter()
        by_seq: dict[int, list[tuple[int, torch.Tensor]]] = {}
        seqs: dict[int, Sequence] = {}
        for seq, pos, lp in got.kept:
            by_seq.setdefault(seq.seq_id, []).append((pos, lp))
            seqs[seq.seq_id] = seq
        values = []
        for seq_id, picks in by_seq.items():
            last = max(p for p, _ in picks)
            ids = torch.tensor([seqs[seq_id].all_ids[: last + 1]])
            ref = torch.log_softmax(reference.logits(ids)[0].float().cpu(), -1)
            values += [float(kl(ref[pos], lp)) for pos, lp in picks]
        arr = np.array(values)
        result.kl_samples = len(values)
        result.kl_mean, result.kl_p90 = _stat(arr, "mean"), _stat(arr, 90)
        result.kl_max = float(arr.max()) if arr.size else None
        result.kl_seconds = time.perf_counter() - start


def _stat(values: np.ndarray, which: str | int) -> float | None:
    """Mean or percentile; None without values (JSON has no NaN)."""
    if not values.size:
        return None
    return float(values.mean() if isinstance(which, str) else np.percentile(values, which))


def _peak_memory(tl: _Timeline) -> tuple[int, str, int | None]:
    """CUDA: what the process really held (runtime/memory/accounting.py's DevicePeak: the caching
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
    shape's first step pays one); /1k tok = dem + pro per 1,000 output tokens; bits = mean bits
    per weight of the widths plan over the steps; KL = mean KL(fp16 || served) of the sampled
    decode steps (--quality-sample), "-" without."""
    columns = ("policy", "load", "req", "out tok/s", "all tok/s", "TTFT ms", "TPOT ms",
               "peak / budget MB", "done", "dem/pro, /1k tok", "bits", "KL", "preempt",
               "captures")  # fmt: skip
    rows = [
        (r.policy, load_label(r.mode, r.load), r.requests, f"{r.output_tok_s:.1f}",
         f"{r.total_tok_s:.1f}", "/".join(_ms(t) for t in (r.ttft_mean_s, r.ttft_p50_s,
         r.ttft_p90_s)), f"{_ms(r.tpot_mean_s)}/{_ms(r.tpot_p90_s)}",
         f"{r.peak_memory_bytes / 1e6:.1f} / {r.memory_budget_bytes / 1e6:.1f}"
         + (" OVER" if r.over_budget else ""),
         f"{r.output_tokens}/{r.requested_tokens}",
         f"{r.demotions}/{r.promotions}, {r.moves_per_1k_tokens:.1f}",
         "-" if r.bits_mean is None else f"{r.bits_mean:.2f}",
         "-" if r.kl_mean is None else f"{r.kl_mean:.4f}", r.preemptions,
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


def load_label(mode: str, load: int) -> str:
    """B4 = batch of 4, C2 = concurrency 2; bursty and trace by name (their `load` is the most
    requests one phase submits)."""
    if mode in ("batch", "concurrency"):
        return f"{mode[0].upper()}{load}"
    return mode


def plot(results: list[ThroughputResult], path: Path, window_s: float | None = None) -> None:
    """Mean bits per weight, KV MB and output tokens/s over time, one line per row (PNG).
    Tokens/s is over a sliding window (default: a twentieth of the longest run)."""
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    longest = max((r.timeline["t_s"][-1] for r in results if r.timeline), default=1.0)
    window = window_s or max(longest / 20, 1e-3)
    for r in results:
        if not r.timeline:
            continue
        tl = r.timeline
        t = np.array(tl["t_s"])
        label = f"{r.policy} {load_label(r.mode, r.load)}"
        axes[0].plot(t, tl["bits"], label=label)
        axes[1].plot(t, np.array(tl["kv_bytes"]) / 1e6, label=label)
        axes[2].plot(t, _rate(t, np.array(tl["output_tokens"]), window), label=label)
    for ax, name in zip(axes, ("mean bits / weight", "KV MB in use", "output tok/s"), strict=True):
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[2].set_xlabel("seconds into the run")
    axes[0].legend(fontsize="small")
    axes[2].set_title(f"output tok/s over the last {window:.3g} s", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _rate(t: np.ndarray, tokens: np.ndarray, window: float) -> np.ndarray:
    """Tokens per second over the `window` seconds before each sample (from the run's start
    while less than a window has passed)."""
    back = np.searchsorted(t, t - window)
    span = t - t[back]
    return np.where(span > 0, (tokens - tokens[back]) / np.maximum(span, 1e-12), 0.0)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"
