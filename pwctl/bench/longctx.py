"""The runner the long-context benches share (`bench --longbench`, `--synthetic`): every prompt
runs on the continuous-batching engine `serve` uses (`Engine.start_batching`, `add_request`,
`step`), under one `--memory-budget`, on fresh engine state for each policy, with `max_seqs`
requests in flight (a closed loop: the next request goes in when one finishes). Greedy, stopping
at eos or the request's token limit.

With each policy's outputs comes the memory they were obtained at, in the engine's accounting:
plane bytes and KV bytes in use (mean over engine steps, and peak), the mean bits per expert
weight those planes make, and the width demotions / promotions and preemptions of the run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pwctl.bench.plotting import pyplot
from pwctl.bench.throughput import fresh_batcher, kv_bytes_in_use
from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.policy import Policy
from pwctl.runtime.engine.batcher import BatchConfig, Batcher
from pwctl.runtime.engine.engine import Engine, experts_for, serving_dtype
from pwctl.runtime.engine.scheduler import SamplingParams, Sequence

# batcher counters reported as their change over a policy's run
MOVES = ("width_demotions", "width_promotions", "preemptions", "steps")


@dataclass(frozen=True)
class Request:
    ids: list[int]
    max_new: int
    # the answer ends at the first newline after some text (LongBench's samsum stops there)
    first_line: bool = False


@dataclass(frozen=True)
class RunSpec:
    """How the engine runs every policy: as `serve` would with these settings."""

    memory_budget: str | None = None  # planes + KV + workspace, as `serve --memory-budget`
    max_seqs: int = 4  # requests in flight
    max_batch_tokens: int = 256  # tokens per engine step
    max_model_len: int | None = None  # prompt + output; None: the model's context

    def validate(self) -> None:
        if self.max_seqs < 1:
            raise PwctlError(f"--max-seqs {self.max_seqs}: must be at least 1")
        if self.max_batch_tokens < 1:
            raise PwctlError(f"--max-batch-tokens {self.max_batch_tokens}: must be at least 1")

    def batch_config(self, n_requests: int) -> BatchConfig:
        return BatchConfig(
            max_seqs=self.max_seqs,
            max_batch_tokens=self.max_batch_tokens,
            max_queue=max(64, n_requests),
            max_model_len=self.max_model_len,
        )


@dataclass
class MemoryReport:
    """The memory a policy's outputs were obtained at (engine accounting, bytes)."""

    memory_budget_bytes: int
    fixed_bytes: int  # non-expert weights + workspace estimate
    mean_total_bytes: float  # fixed + planes + KV in use, mean over engine steps
    peak_total_bytes: int  # ... at the step it peaked
    mean_plane_bytes: float
    peak_plane_bytes: int
    mean_kv_bytes: float  # KV blocks in use
    peak_kv_bytes: int
    bits_per_weight: float  # mean plane bytes x 8 / expert weights (tables included)
    demotions: int  # blocks whose width went down / up during the run
    promotions: int
    preemptions: int
    steps: int

    @property
    def traded_bytes(self) -> float:
        """Planes + KV (mean), the memory a policy trades between."""
        return self.mean_plane_bytes + self.mean_kv_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Trace:
    """Plane and KV bytes after every step of one run."""

    planes: list[int] = field(default_factory=list)
    kv: list[int] = field(default_factory=list)

    def record(self, batcher: Batcher, got: list[Sequence]) -> None:
        self.planes.append(batcher.memory.planes)
        self.kv.append(kv_bytes_in_use(batcher, got))


class EnginePool:
    """One engine per expert backend a policy wants, as `serve` would pick it: on CUDA the
    paged planes (fp16: the 16-bit experts, in bf16), the store on the CPU; each loaded on
    first use."""

    def __init__(self, pack: Pack, device: str = "cpu", max_bits: int | None = None):
        self.pack, self.device, self.max_bits = pack, device, max_bits
        self._engines: dict[str, Engine] = {}

    def __call__(self, policy: Policy) -> Engine:
        kind = experts_for(policy, self.device)
        if kind not in self._engines:
            self._engines[kind] = Engine(
                self.pack, self.device, serving_dtype(self.device, kind), kind, self.max_bits
            )
        return self._engines[kind]


EngineFor = Callable[[Policy], Engine]


def engine_for(engines: Engine | EngineFor) -> EngineFor:
    """A single engine serves every policy; a pool picks one per policy."""
    if isinstance(engines, Engine):
        return lambda _policy: engines
    return engines


def run_policy(
    engine: Engine, policy: Policy, requests: list[Request], spec: RunSpec
) -> tuple[list[str], MemoryReport]:
    """Every request's output text, in order, and the memory of the run."""
    spec.validate()
    if not requests:
        raise PwctlError("no requests to run")
    batcher = fresh_batcher(engine, policy, spec.memory_budget, spec.batch_config(len(requests)))
    before = batcher.metrics()
    texts, trace = _closed_loop(batcher, requests, spec.max_seqs)
    after = batcher.metrics()
    return texts, _report(engine, trace, before, after)


def _report(
    engine: Engine, trace: _Trace, before: dict[str, Any], after: dict[str, Any]
) -> MemoryReport:
    weights = sum(b.rows * b.cols for b in engine.pack.blocks)
    steps = max(1, len(trace.planes))
    mean_planes, mean_kv = sum(trace.planes) / steps, sum(trace.kv) / steps
    fixed = after["fixed_bytes"]
    peak = max((p + k for p, k in zip(trace.planes, trace.kv, strict=True)), default=0)
    return MemoryReport(
        after["memory_budget_bytes"], fixed, fixed + mean_planes + mean_kv, fixed + peak,
        mean_planes, max(trace.planes, default=0), mean_kv, max(trace.kv, default=0),
        mean_planes * 8 / weights, *(after[k] - before[k] for k in MOVES),
    )  # fmt: skip


def _closed_loop(
    batcher: Batcher, requests: list[Request], in_flight: int
) -> tuple[list[str], _Trace]:
    trace = _Trace()
    seqs: list[Sequence] = []
    index: dict[int, int] = {}  # seq_id -> request

    def submit() -> None:
        r = requests[len(seqs)]
        seq = batcher.add(r.ids, SamplingParams(max_tokens=r.max_new))
        index[seq.seq_id] = len(seqs)
        seqs.append(seq)

    for _ in range(min(in_flight, len(requests))):
        submit()
    while batcher.has_work:
        got = batcher.step()
        batcher.catch_up_text()  # a first-line answer is judged on the text of this step's token
        trace.record(batcher, got)
        done = 0
        for seq in got:
            wants_line = requests[index[seq.seq_id]].first_line
            if wants_line and not seq.finished and _first_line_done(seq.text):
                batcher.abort(seq.seq_id)  # its answer is complete: free its slot
            done += seq.finished
        for _ in range(min(done, len(requests) - len(seqs))):
            submit()
    texts = [_answer(s.text, requests[i].first_line) for i, s in enumerate(seqs)]
    return texts, trace


def _first_line_done(text: str) -> bool:
    return "\n" in text.lstrip("\n")


def _answer(text: str, first_line: bool) -> str:
    """The output; with `first_line`, up to the first newline after some text."""
    if not first_line:
        return text
    lead = len(text) - len(text.lstrip("\n"))
    end = text.find("\n", lead)
    return text if end < 0 else text[:end]


# ----------------------------------------------------------------------------- reports

MEMORY_COLUMNS = ("policy", "score", "total MB mean/peak", "planes MB mean/peak",
                  "KV MB mean/peak", "bits/weight", "dem/pro", "preempt", "budget MB")  # fmt: skip
Point = tuple[str, float, MemoryReport]  # policy, score, the memory it was obtained at


def memory_table(points: list[Point], score: str) -> tuple[str, tuple[str, ...], list[tuple]]:
    """(title, columns, rows) for print_table: each score next to its memory."""
    rows = [
        (policy, f"{value:.2f}", _mb(m.mean_total_bytes, m.peak_total_bytes),
         _mb(m.mean_plane_bytes, m.peak_plane_bytes), _mb(m.mean_kv_bytes, m.peak_kv_bytes),
         f"{m.bits_per_weight:.2f}", f"{m.demotions}/{m.promotions}", m.preemptions,
         f"{m.memory_budget_bytes / 1e6:.2f}")
        for policy, value, m in points
    ]  # fmt: skip
    title = f"{score} and the memory it was obtained at (engine accounting, over engine steps)"
    return title, MEMORY_COLUMNS, rows


def _mb(mean: float, peak: int) -> str:
    return f"{mean / 1e6:.2f}/{peak / 1e6:.2f}"


def plot_scores(points: list[Point], path: Path, score: str) -> None:
    """Score against mean memory (planes + KV), a line per policy family (uniform:2..8 make
    one line, pagedweight:0.3 and :0.5 another), written as a PNG."""
    plt = pyplot()

    families: dict[str, list[tuple[float, float, str]]] = {}
    for policy, value, m in points:
        families.setdefault(policy.split(":")[0], []).append((m.traded_bytes / 1e6, value, policy))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for family, pts in families.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=family)
        for x, y, policy in pts:
            ax.annotate(policy, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("memory, MB (expert planes + KV cache, mean over engine steps)")
    ax.set_ylabel(score)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
