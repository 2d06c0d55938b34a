"""The continuous-batching loop of the engine: schedule, launch the packed batch, and while the
GPU runs it feed the policy the last step's signals and rebalance planes against KV blocks; then
sample and check stops. `Engine.start_batching` builds one; `Batcher.step` is one step (the
server's engine thread calls it in a loop).

Overlapped steps (`BatchConfig.overlap`, where decode graphs run): a step's tokens are sampled
on the device and left there; the next decode step is scheduled and launched reading them there,
and only then does the host wait for them, so the GPU runs one step while the host prepares the
next (the host's part of a 32-sequence step was ~1 ms of a 4.2 ms step on an H100:
docs/decisions/045-overlapped-decode-steps.md). `step` then returns the sequences of the step
before. What a token decides waits a step: a sequence that stops on it ran one row more, thrown
away. A sequence that reaches its length on it sits the next step out (`Scheduler.schedule`'s
hold), so no row goes past max_tokens or the context."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pwctl.errors import PwctlError
from pwctl.runtime.engine.decode_graphs import DeviceTokens
from pwctl.runtime.engine.detokenizer import advance, advance_many, first_stop
from pwctl.runtime.engine.runner import ModelRunner
from pwctl.runtime.engine.sampler import SampledTokens, sample_tokens
from pwctl.runtime.engine.scheduler import SamplingParams, ScheduledBatch, Scheduler, Sequence
from pwctl.runtime.memory.budget import MemoryBudget
from pwctl.runtime.moe.block import MoETap
from pwctl.runtime.widths.allocator import StepSignals, WidthAllocator

T = TypeVar("T")
RATE_WINDOW_S = 10.0  # tokens/s is measured over this many recent seconds


@dataclass(frozen=True)
class BatchConfig:
    max_seqs: int = 16  # sequences running at once
    max_batch_tokens: int = 256  # tokens per step (decodes + prefill chunks)
    max_queue: int = 64  # waiting requests before add() raises QueueFull
    block_size: int = 16  # tokens per KV block
    max_model_len: int | None = None  # prompt + output; None: the model's context
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (paged experts on CUDA)
    overlap: bool = True  # a decode step launches before the host reads the last one's tokens


@dataclass(frozen=True)
class Launched:
    """A step on its way: its batch, the sequences that sample, their tokens."""

    batch: ScheduledBatch
    sampled: list[Sequence]
    tokens: SampledTokens

    def fed(self) -> DeviceTokens:
        return DeviceTokens(self.tokens.device, {s.seq_id: i for i, s in enumerate(self.sampled)})


@dataclass
class Counters:
    steps: int = 0
    prompt_tokens: int = 0  # tokens prefilled (recomputed ones included)
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    copied_bytes: int = 0  # planes copied host -> device at step boundaries (paged backend)


class Batcher:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        memory: MemoryBudget,
        tokenizer: Any,
        eos_ids: set[int],
        max_model_len: int,
        allocator: WidthAllocator | None = None,
        boundary: Callable[[], int] | None = None,
        overlap: bool = True,
    ):
        """`boundary`: called at every step boundary, after the schedule's demotions and the
        last step's promotions were requested and before the step launches anything (the
        paged backend's commit: the only time the widths kernels read change); returns the
        bytes it started copying. `overlap`: keep a decode step's tokens on the device until the
        next step has launched (only where the runner has decode graphs)."""
        self.runner, self.scheduler, self.memory = runner, scheduler, memory
        self.overlap = overlap
        self._launched: Launched | None = None  # the last step, its tokens not yet read
        self.boundary = boundary
        self.kv = scheduler.kv
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, eos_ids, max_model_len
        self.allocator = allocator
        self.tap = None
        if allocator is not None:  # the planner's signals: the routing, inputs where it reads them
            self.tap = MoETap(runner.model, inputs=allocator.reads_inputs, weights=False)
        self._signals: StepSignals | None = None  # the last step's, fed during the next
        # sequences whose text waits for the next step's launch: their new token stops nothing
        # that needs text, so it is decoded while the GPU runs that step (32 sequences' text
        # took ~0.6 ms a step on the 2-core CPU, with the GPU idle waiting for the next launch)
        self._untexted: list[Sequence] = []
        self.counters = Counters()
        self.info: dict[str, str] = {}  # what serves: policy, device, experts (start_batching)
        self._tok_lock = threading.Lock()  # the server tokenizes in another thread
        self._recent: deque[tuple[float, int]] = deque()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._launched is not None

    def check(self, n_prompt: int, params: SamplingParams) -> None:
        """Raise PwctlError if a request of `n_prompt` tokens and `params` can never run."""
        total = n_prompt + params.max_tokens
        if n_prompt < 1:
            raise PwctlError("empty prompt")
        if total > self.max_model_len:
            raise PwctlError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens"
            )
        if self.kv.blocks_for(total) > self.kv.pool.capacity:
            raise PwctlError(
                f"prompt + max_tokens ({total} tokens) needs more KV memory than the memory "
                f"budget can give ({self.kv.pool.capacity * self.kv.block_size} tokens)"
            )

    def encode(self, text: str) -> list[int]:
        return self.locked(lambda: self.tokenizer(text).input_ids)

    def locked(self, fn: Callable[[], T]) -> T:
        """Run `fn` (which uses the tokenizer) while no other thread uses it."""
        with self._tok_lock:
            return fn()

    def add(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.check(len(prompt_ids), params)
        seq = Sequence(list(prompt_ids), params)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        seq = self.scheduler.abort(seq_id)
        if seq is not None:
            self.counters.aborted += 1
            self._detokenize(seq, seq.output_ids, final=True)  # its text as far as it got
        return seq

    def step(self) -> list[Sequence]:
        """One step; returns the sequences that got a token (finished ones included): this
        step's, or with overlap the step before's."""
        last, self._launched = self._launched, None
        batch = self.scheduler.schedule(self._ending(last))
        done: list[Sequence] = []
        if last is not None and not self.runner.takes_device_tokens(batch):
            done, last = self._land(last), None  # packed rows: every token on the host first
            batch = batch.without_finished()
        if not batch.seqs:
            return done + self._land(last) if last is not None else done or self._unschedulable()
        self._boundary()
        with self.tap if self.tap is not None else nullcontext():
            logits = self._forward(batch, last)
        signals = self.allocator.signals(self.tap) if self.allocator is not None else None  # type: ignore[arg-type]  # a tap exists with an allocator
        sampled = [s for s, on in zip(batch.seqs, batch.sampling, strict=True) if on]
        now = Launched(batch, sampled, SampledTokens.queue(sample_tokens(logits, sampled)))
        for seq in sampled:
            seq.pending += 1
        self.scheduler.update(batch)
        # while the GPU runs this step: the tokens of the one before (overlapped), the last
        # step's text, its signals to the planner, spare KV bytes to the planes (the widths
        # change at the next boundary either way)
        if last is not None:
            done = self._land(last)
        self.catch_up_text()
        self._feed()
        self.memory.rebalance(self._kv_wanted())
        self._signals = signals
        if self.overlap and self.runner.graphs is not None:
            self._launched = now
            return done
        return done + self._land(now)

    def _forward(self, batch: ScheduledBatch, last: Launched | None) -> torch.Tensor:
        """The runner's forward; out of device memory becomes one line: on CUDA torch's
        allocator is held to the memory budget (accounting.cap_allocator), so a step past it
        took more than the start-up measured."""
        try:
            return self.runner.forward(batch, last.fed() if last is not None else None)
        except torch.OutOfMemoryError as e:
            raise PwctlError(
                f"a step of {batch.total} tokens over {len(batch.seqs)} sequences ran out of "
                f"device memory within --memory-budget ({self.memory.total / 1e6:.0f} MB; the "
                f"fixed part {self.memory.fixed / 1e6:.0f} MB): please report it; a larger "
                f"budget or a smaller --max-seqs avoids it ({str(e).splitlines()[0]})"
            ) from e

    def idle(self) -> None:
        """No work: the last step's text and signals catch up, the planner's step clock advances
        (its cooldown counts engine steps) and the KV cache's spare memory goes back to the
        planes."""
        self.catch_up_text()
        self._feed()
        if self.allocator is not None:
            self.allocator.planner.tick()
            self.memory.rebalance(self._kv_wanted())
        self._boundary()  # promotions start copying now, not at the next step

    def run(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Every prompt to completion (the queue bound applies: at most max_queue prompts)."""
        seqs = [self.add(p, params) for p in prompts]
        while self.has_work:
            self.step()
        return seqs

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S seconds."""
        self._trim(time.monotonic())
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0

    # --- internals ------------------------------------------------------------------------------

    def catch_up_text(self) -> None:
        """The text of every token a running sequence got at the last step (finished ones have
        theirs): `seq.text` lags the tokens by at most one step between steps."""
        seqs, self._untexted = self._untexted, []
        if not seqs:
            return
        items = [(seq.output_ids, seq.text, seq.offsets, False) for seq in seqs]
        texts = self.locked(lambda: advance_many(self.tokenizer, items))
        for seq, text in zip(seqs, texts, strict=True):
            seq.text = text

    def _land(self, step: Launched) -> list[Sequence]:
        """Read a launched step's tokens (waits for that step alone) and append them; the
        sequences that got one (not those that finished since the step was scheduled)."""
        got = []
        for seq, token in zip(step.sampled, step.tokens.host(), strict=True):
            seq.pending -= 1
            if not seq.finished:
                self._append(seq, token)
                got.append(seq)
        self._count(step.batch.total - len(step.sampled), len(step.sampled))
        return got

    def _ending(self, last: Launched | None) -> frozenset[int]:
        """Sequences whose token still on the device reaches their max_tokens or the context:
        they end on it, so they sit the next step out."""
        if last is None:
            return frozenset()
        return frozenset(s.seq_id for s in last.sampled if self._at_length(s, ahead=1))

    def _at_length(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether `seq` has reached its max_tokens or the context, counting `ahead` tokens
        still on the device."""
        n = len(seq.output_ids) + ahead
        return n >= seq.params.max_tokens or len(seq.prompt_ids) + n >= self.max_model_len

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        p = seq.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self._detokenize(seq, seq.output_ids[:-1], final=True)  # the stop token adds no text
            return self._finish(seq, "stop")
        if p.stop:  # stop strings: the text is needed now
            checked = len(seq.text)
            self._detokenize(seq, seq.output_ids)
            cut = first_stop(seq.text, checked, p.stop)
            if cut >= 0:
                seq.text = seq.text[:cut]
                return self._finish(seq, "stop")
        if self._at_length(seq):
            self._detokenize(seq, seq.output_ids, final=True)
            return self._finish(seq, "length")
        if p.stream and not p.stop:
            self._untexted.append(seq)
        return None

    def _detokenize(self, seq: Sequence, ids: list[int], final: bool = False) -> None:
        seq.text = self.locked(lambda: advance(self.tokenizer, ids, seq.text, seq.offsets, final))

    def _feed(self) -> None:
        """The last step's signals to the policy's planner, if a step left some."""
        if self._signals is not None:
            assert self.allocator is not None  # only an allocator leaves signals
            self.allocator.feed(self._signals)
            self._signals = None

    def _boundary(self) -> None:
        if self.boundary is not None:
            self.counters.copied_bytes += self.boundary()

    def _unschedulable(self) -> list[Sequence]:
        """Nothing runs and the queue's head does not fit even after demoting to the floors
        (hot-expert floors can hold planes above BUDGET): drop it rather than spin."""
        sched = self.scheduler
        if sched.running or not sched.waiting:
            return []
        seq = sched.waiting[0]
        self._finish(seq, "abort")
        return [seq]

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.counters.finished += 1

    def _kv_wanted(self) -> int:
        """Blocks the KV cache should keep: in use, one more per running sequence, and the
        prompts waiting (so planes do not take memory a queued request needs next)."""
        waiting = sum(self.kv.blocks_for(s.remaining) for s in self.scheduler.waiting)
        return min(self.kv.pool.capacity, self.kv.used + len(self.scheduler.running) + waiting)

    def _count(self, prompt: int, generated: int) -> None:
        c = self.counters
        c.steps += 1
        c.prompt_tokens += prompt
        c.generated_tokens += generated
        now = time.monotonic()
        self._recent.append((now, generated))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def metrics(self) -> dict[str, Any]:
        """A snapshot for /metrics and logs (call from the thread that runs steps)."""
        mem, kv, c, moves = self.memory, self.kv, self.counters, self.memory.moves
        out = {
            "info": dict(self.info),
            "memory_budget_bytes": mem.total,
            "fixed_bytes": mem.fixed,
            "plane_bytes": mem.planes,
            "kv_block_bytes": kv.block_bytes,
            "kv_blocks_used": kv.used,
            "kv_blocks_limit": kv.pool.limit,
            "kv_blocks_capacity": kv.pool.capacity,
            "width_demotions": moves.demotions,
            "width_demoted_bytes": moves.demoted_bytes,
            "width_promotions": moves.promotions,
            "width_promoted_bytes": moves.promoted_bytes,
            "plane_copied_bytes": c.copied_bytes,
            "preemptions": self.scheduler.preemptions,
            "queue_length": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "steps": c.steps,
            "prompt_tokens": c.prompt_tokens,
            "generated_tokens": c.generated_tokens,
            "finished": c.finished,
            "aborted": c.aborted,
            "tokens_per_s": self.tokens_per_s(),
            "widths_per_layer": mem.widths_per_layer(),
        }
        if mem.paged is not None:  # the one arena: slabs held by planes, KV blocks, free
            out["arena_slabs"] = mem.paged.pager.counts()
        if self.runner.graphs is not None:
            out.update(self.runner.graphs.stats())
        return out
