"""Continuous batching: which sequences run in the next step and how many of their tokens.

Each step has a token budget shared by decodes (one token per running sequence) and prefills
(prompt chunks of waiting or partly prefilled sequences), so prefill and decode mix in one
packed batch. Running sequences go first, oldest first; waiting ones join while the budget, the
sequence cap and the KV cache allow. When a running sequence needs a KV block and none is free,
the scheduler first asks `make_room` (the memory budget: demote expert planes) and then preempts
the newest running sequence by recompute: its blocks go back, it returns to the front of the
queue, and later its prompt plus what it generated so far is prefilled again.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from pwctl.errors import PwctlError
from pwctl.runtime.engine.detokenizer import TextOffsets
from pwctl.runtime.memory.kv_cache import KVCache


class QueueFull(PwctlError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()  # besides the model's eos
    ignore_eos: bool = False
    seed: int | None = None
    # the text follows the tokens step by step (a streamed response reads it); False: it is
    # made once, when the sequence ends (stop strings make it step by step either way)
    stream: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise PwctlError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise PwctlError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise PwctlError("top_p must be in (0, 1]")
        # a generator takes it at the sequence's first draw, inside a step: check it here
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise PwctlError("seed must fit in 64 bits")


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop", "length" or "abort"
    text: str = ""  # the detokenized output so far (the engine keeps it)
    offsets: TextOffsets = field(default_factory=TextOffsets)  # where `text` stands in output_ids
    preemptions: int = 0
    pending: int = 0  # tokens sampled on the device, not yet read by the host (batcher.py)
    arrival: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None  # a seeded sequence's, made by its first draw

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise PwctlError("empty prompt")

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens the host knows: the prompt and the outputs read so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache (the prompt, or the last sampled token, which may still
        be on the device)."""
        return self.num_tokens + self.pending - self.num_computed

    def ids(self, start: int, stop: int) -> list[int]:
        """Tokens start..stop-1 the host knows (`all_ids[start:stop]` without building all_ids:
        a step reads a few tokens of sequences thousands long)."""
        n = len(self.prompt_ids)
        head = self.prompt_ids[start:stop] if start < n else []
        return head + self.output_ids[max(start - n, 0) : max(stop - n, 0)]

    def token_at(self, i: int) -> int | None:
        """Token i (prompt, then outputs); None for one still on the device."""
        n = len(self.prompt_ids)
        if i < n:
            return self.prompt_ids[i]
        return self.output_ids[i - n] if i - n < len(self.output_ids) else None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    n_tokens: list[int] = field(default_factory=list)  # each runs tokens num_computed.. +n
    sampling: list[bool] = field(default_factory=list)  # reaches its last token: samples one
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.n_tokens.append(n)
        self.sampling.append(seq.num_computed + n == seq.num_tokens + seq.pending)

    @property
    def total(self) -> int:
        return sum(self.n_tokens)

    def without_finished(self) -> ScheduledBatch:
        """This batch less the sequences that finished since it was scheduled (their blocks
        went back when they did)."""
        out = ScheduledBatch(preempted=self.preempted)
        for seq, n, on in zip(self.seqs, self.n_tokens, self.sampling, strict=True):
            if not seq.finished:
                out.seqs.append(seq)
                out.n_tokens.append(n)
                out.sampling.append(on)
        return out


class Scheduler:
    def __init__(
        self,
        kv: KVCache,
        max_batch_tokens: int = 256,
        max_seqs: int = 16,
        max_queue: int = 64,
        make_room: Callable[[int, bool], bool] | None = None,
    ):
        if max_batch_tokens < 1 or max_seqs < 1 or max_queue < 0:
            raise PwctlError("max_batch_tokens and max_seqs must be >= 1, max_queue >= 0")
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.max_queue = max_queue
        self.make_room = make_room
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.max_queue} requests)")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a sequence wherever it is; its blocks go back. None if it is not here."""
        for seq in itertools.chain(self.running, self.waiting):
            if seq.seq_id == seq_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        self.kv.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def schedule(self, hold: frozenset[int] = frozenset()) -> ScheduledBatch:
        """The next step's batch; running sequences whose ids are in `hold` sit it out (their
        last token, still on the device, ends them: batcher.py)."""
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_batch_tokens, hold)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def update(self, batch: ScheduledBatch) -> None:
        """The step ran: the scheduled tokens' K/V are in the cache."""
        for seq, n in zip(batch.seqs, batch.n_tokens, strict=True):
            seq.num_computed += n

    # --- internals ------------------------------------------------------------------------------

    def _schedule_running(self, batch: ScheduledBatch, budget: int, hold: frozenset[int]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.seq_id in hold:
                i += 1
                continue
            n = min(seq.remaining, budget)
            if not self._reserve(seq, n, batch):
                break  # seq itself was preempted: everything after it already was
            batch.add(seq, n)
            budget -= n
            i += 1
        return budget

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Blocks for `n` more tokens of a running `seq`, preempting the newest running
        sequences until they fit; False when `seq` itself had to go."""
        while not self._grow(seq, seq.num_computed + n, urgent=True):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _grow(self, seq: Sequence, n_tokens: int, urgent: bool = False) -> bool:
        """Blocks for `seq` up to `n_tokens`, asking `make_room` for them if none are free
        (`urgent`: else a running sequence is preempted, or nothing could ever run)."""
        if self.kv.grow(seq.seq_id, n_tokens):
            return True
        need = self.kv.need(seq.seq_id, n_tokens) - self.kv.available
        if self.make_room is not None and self.make_room(need, urgent):
            return self.kv.grow(seq.seq_id, n_tokens)
        return False

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.kv.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed, seq.status = 0, Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            n = min(seq.remaining, budget)
            if not self._grow(seq, seq.num_computed + n, urgent=not self.running):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
