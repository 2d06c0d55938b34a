"""The engine thread: one background thread owns the model and runs continuous-batching steps;
HTTP handlers talk to it only through queues (an inbox of commands, one asyncio queue of
updates per request).

A handler calls `submit` (which enforces the queue bound and raises QueueFull at once), then
reads `Update`s from its `Request.updates` until one is final; `cancel` (client gone) aborts the
sequence in the engine thread, which frees its KV blocks. An exception inside a step fails the
requests in flight with an error update and the thread keeps serving, except a block that has
no good width left (BlockUnavailable: a checksum failure): then the engine is down, and every
request, in flight or new, gets a 503.

`health()` is what /health reports: ok; degraded (a plane or reference tensor failed its
checksum, its block runs at its last good width); or down.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import QueueFull, SamplingParams, Sequence
from pwctl.runtime.memory.expert_store import BlockUnavailable

log = logging.getLogger("pwctl.serve")


@dataclass(frozen=True)
class Update:
    text: str  # the whole output text so far (stop strings cut)
    tokens: int  # output tokens so far
    finish_reason: str | None = None  # set on the last update
    error: str | None = None  # the engine failed this request
    status: int = 500  # the HTTP status of that error (503: the engine cannot serve)

    @classmethod
    def of(cls, seq: Sequence) -> Update:
        """A sequence's text, tokens and finish reason now."""
        return cls(seq.text, len(seq.output_ids), seq.finish_reason)


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq_id: int | None = None

    def push(self, update: Update) -> None:
        """From the engine thread: hand an update to the request's event loop."""
        self.loop.call_soon_threadsafe(self.updates.put_nowait, update)


class EngineWorker:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        if engine.batcher is None:
            raise ValueError("start_batching before starting the worker")
        self.engine, self.batcher = engine, engine.batcher
        self.idle_wait_s = idle_wait_s
        self.inbox: queue.Queue[tuple[str, Request]] = queue.Queue()
        self.active: dict[int, Request] = {}
        self._pending = 0  # submitted, not yet in the scheduler
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pwctl-engine", daemon=True)
        self._metrics: dict[str, Any] = self.batcher.metrics()
        self.failure: str | None = None  # why the engine cannot serve any request, if so

    # --- from request handlers ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def serving(self) -> bool:
        return self.alive and self.failure is None

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /health: 200 only when every check passed and the engine
        runs."""
        faults = [str(f) for f in self.engine.store.faults]  # the engine thread appends
        if not self.serving:
            why = self.failure or "the engine thread is not running"
            return 503, {"status": "down", "error": why, "faults": faults}
        if faults:
            return 503, {"status": "degraded", "faults": faults}
        return 200, {"status": "ok"}

    def submit(self, request: Request) -> None:
        """Queue a request for the engine thread; QueueFull when the waiting queue is full."""
        with self._lock:
            waiting = self._pending + self._metrics["queue_length"]
            if waiting >= self.batcher.scheduler.max_queue:
                raise QueueFull(f"server busy: {waiting} requests are waiting")
            self._pending += 1
        self.inbox.put(("add", request))

    def cancel(self, request: Request) -> None:
        """The client is gone: abort its sequence (its KV blocks are freed)."""
        self.inbox.put(("abort", request))

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._metrics)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.batcher.has_work
            if self._drain(block=idle) == 0 and idle:
                self.batcher.idle()
                self._publish_metrics()
            if self.batcher.has_work:
                self._step()

    def _drain(self, block: bool) -> int:
        """Handle every queued command (waiting up to idle_wait_s for one if `block`)."""
        commands = self._take(block)
        for command in commands:
            self._handle(*command)
        if commands:
            self._publish_metrics()
        return len(commands)

    def _take(self, block: bool) -> list[tuple[str, Request]]:
        """Every command queued now (waiting up to idle_wait_s for one if `block`)."""
        commands: list[tuple[str, Request]] = []
        try:
            commands.append(self.inbox.get(timeout=self.idle_wait_s) if block
                            else self.inbox.get_nowait())  # fmt: skip
            while True:
                commands.append(self.inbox.get_nowait())
        except queue.Empty:
            return commands

    def _handle(self, kind: str, request: Request) -> None:
        if kind == "abort":
            if request.seq_id is not None and self.active.pop(request.seq_id, None) is not None:
                self.batcher.abort(request.seq_id)
            return
        if self.failure is not None:
            with self._lock:
                self._pending -= 1
            request.push(Update("", 0, "abort", error=self.failure, status=503))
            return
        try:
            seq = self.batcher.add(request.prompt_ids, request.params)
        except QueueFull as e:  # the queue filled after submit() admitted it (preemptions)
            request.push(Update("", 0, "abort", error=f"busy: {e}"))
            return
        except Exception as e:  # a request the handler's checks let through
            request.push(Update("", 0, "abort", error=str(e)))
            return
        finally:
            # one update of both counts: between two metric snapshots, submit() must not see a
            # request in neither (it admitted past the bound, and add() then refused: HTTP 503)
            with self._lock:
                self._pending -= 1
                self._metrics["queue_length"] = len(self.batcher.scheduler.waiting)
        request.seq_id = seq.seq_id
        self.active[seq.seq_id] = request

    def _step(self) -> None:
        try:
            seqs = self.batcher.step()
        except BlockUnavailable as e:  # a checksum failure with no width to fall back to
            log.error("the engine cannot serve: %s", e)
            self.failure = f"the engine cannot serve: {e}"
            self._fail_all(self.failure, 503)
            return
        except Exception as e:  # never let one bad step take the server down
            log.exception("engine step failed")
            self._fail_all(f"engine error: {e}")
            return
        for seq in seqs:
            self._send(seq)
        self._publish_metrics()

    def _send(self, seq: Sequence) -> None:
        request = self.active.get(seq.seq_id)
        if request is None:
            return
        request.push(Update.of(seq))
        if seq.finished:
            del self.active[seq.seq_id]

    def _fail_all(self, message: str, status: int = 500) -> None:
        for seq_id, request in list(self.active.items()):
            self.batcher.abort(seq_id)
            request.push(Update("", 0, "abort", error=message, status=status))
        self.active.clear()

    def _publish_metrics(self) -> None:
        snapshot = self.batcher.metrics()
        with self._lock:
            self._metrics = snapshot
