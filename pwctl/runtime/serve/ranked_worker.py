"""`pwctl serve --expert-parallel N`: one HTTP front end (rank 0's) over N ranks that share the
experts. Each rank serves the requests it is given with its own engine and KV cache; they step
together, since every MoE layer's all-to-all needs every rank.

Each turn of rank 0's engine thread: it takes what the handlers queued, gives each new request
to the least loaded rank (running + waiting sequences, as the ranks last reported, plus what it
gave since), and broadcasts these orders (adds, aborts, or stop); every rank takes its own, steps
(or joins the exchanges with no tokens, or idles when no rank has work) and reports its
requests' updates, its load and its metrics, gathered on rank 0, which hands each update to its
request. While nothing runs rank 0 still turns every `idle_wait_s`: the others wait in the
broadcast, and the group's timeout must not pass. The orders and reports travel pickled between
our own ranks (torch.distributed's object collectives), never through a file.

A rank that dies breaks the next collective within the group's timeout: rank 0 then fails every
request (503), /health says down, and the other ranks leave with the error."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from pwctl.errors import PwctlError
from pwctl.runtime.engine.scheduler import SamplingParams
from pwctl.runtime.parallel.gather import gather_to_first
from pwctl.runtime.parallel.launch import leave
from pwctl.runtime.parallel.rank_metrics import rank_metrics
from pwctl.runtime.parallel.ranks import RankEngine
from pwctl.runtime.serve.worker import EngineWorker, Request, Update

log = logging.getLogger("pwctl.serve")


@dataclass(frozen=True)
class Orders:
    """What rank 0 tells every rank before a step; each add and abort names its rank."""

    adds: list[tuple[int, int, list[int], SamplingParams]] = field(default_factory=list)
    aborts: list[tuple[int, int]] = field(default_factory=list)  # (rank, request key)
    stop: bool = False  # the front end is closing: the other ranks leave


@dataclass(frozen=True)
class Report:
    """What a rank tells rank 0 after a step: (request key, update) pairs, and its load."""

    updates: list[tuple[int, Update]]
    running: int
    waiting: int
    metrics: dict[str, Any]


class RankTurns:
    """One rank's side of every turn: take its orders, step with every rank, report."""

    def __init__(self, ranks: RankEngine):
        self.ranks, self.batcher = ranks, ranks.batcher
        self.rank = dist.get_rank(ranks.group)
        self.key_of: dict[int, int] = {}  # sequence id -> request key (rank 0's)
        self.seq_of: dict[int, int] = {}  # request key -> sequence id

    def turn(self, orders: Orders) -> list[Report] | None:
        """One turn (a collective: every rank takes every turn); rank 0 gets every report."""
        updates = self._obey(orders)
        if self.ranks.has_work:
            updates += [(self.key_of[s.seq_id], Update.of(s)) for s in self.ranks.step()
                        if s.seq_id in self.key_of]  # fmt: skip
        else:
            self.batcher.idle()
        for key, update in updates:
            if update.finish_reason is not None:
                self.key_of.pop(self.seq_of.pop(key, -1), None)
        sched = self.batcher.scheduler
        metrics = {"rank": self.rank, **rank_metrics(self.batcher, self.ranks.exchange.stats)}
        report = Report(updates, len(sched.running), len(sched.waiting), metrics)
        return gather_to_first(report, self.ranks.group)

    def _obey(self, orders: Orders) -> list[tuple[int, Update]]:
        """Add and abort this rank's requests; a request it cannot take gets its error."""
        refused = []
        for rank, key, prompt_ids, params in orders.adds:
            if rank != self.rank:
                continue
            try:
                seq = self.batcher.add(prompt_ids, params)
            except Exception as e:  # a full queue, or a request the front end's checks let by
                refused.append((key, Update("", 0, "abort", error=str(e))))
                continue
            self.key_of[seq.seq_id], self.seq_of[key] = key, seq.seq_id
        for rank, key in orders.aborts:
            if rank == self.rank and key in self.seq_of:
                seq_id = self.seq_of.pop(key)
                self.key_of.pop(seq_id, None)
                self.batcher.abort(seq_id)
        return refused


def follow(ranks: RankEngine) -> None:
    """A rank other than 0: take rank 0's orders and turn until it says stop."""
    turns = RankTurns(ranks)
    while not (orders := _broadcast(None, ranks.group)).stop:
        turns.turn(orders)
    leave(ranks.group)  # every rank has its stop order before any tears the group down


class RankedWorker(EngineWorker):
    """Rank 0's engine thread: the front end's worker, its requests spread over the ranks."""

    def __init__(self, ranks: RankEngine, idle_wait_s: float = 0.05):
        super().__init__(ranks.engine, idle_wait_s)
        self.ranks, self.turns = ranks, RankTurns(ranks)
        self.world = dist.get_world_size(ranks.group)
        self.loads = [0] * self.world  # running + waiting a rank, as last reported
        self.requests: dict[int, Request] = {}  # key -> request in flight on some rank
        self.rank_of: dict[int, int] = {}  # key -> the rank serving it
        self._keys = 0
        self._busy = False  # some rank had work at the last turn

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                reports = self.turns.turn(_broadcast(self._orders(), self.ranks.group))
                if reports is not None:
                    self._deliver(reports)
            _broadcast(Orders(stop=True), self.ranks.group)
            leave(self.ranks.group)
        except Exception as e:  # a rank died or timed out, or a step failed: the ranks are out
            log.error("expert-parallel serving stopped: %s", e)  # of step, nothing more serves
            self.failure = f"expert-parallel serving stopped: {e}"
            self._fail_all(self.failure, 503)

    def _orders(self) -> Orders:
        """What the handlers queued since the last turn (waiting up to idle_wait_s for some
        while no rank has work), as orders to the ranks."""
        orders = Orders()
        for kind, request in self._take(block=not self._busy):
            if kind == "abort":
                key = request.seq_id
                if key is not None and self.requests.pop(key, None) is not None:
                    orders.aborts.append((self.rank_of.pop(key), key))
            else:
                self._place(request, orders)
        return orders

    def _place(self, request: Request, orders: Orders) -> None:
        """A new request to the least loaded rank (the lowest of equals)."""
        with self._lock:
            self._pending -= 1
        if self.failure is not None:
            request.push(Update("", 0, "abort", error=self.failure, status=503))
            return
        rank = min(range(self.world), key=lambda r: (self.loads[r], r))
        self.loads[rank] += 1
        self._keys += 1
        key = request.seq_id = self._keys
        self.requests[key], self.rank_of[key] = request, rank
        orders.adds.append((rank, key, request.prompt_ids, request.params))

    def _deliver(self, reports: list[Report]) -> None:
        """Each update to its request; the ranks' loads and metrics for the next turn."""
        for report in reports:
            for key, update in report.updates:
                request = self.requests.get(key)
                if request is None:  # aborted meanwhile
                    continue
                request.push(update)
                if update.finish_reason is not None:
                    del self.requests[key], self.rank_of[key]
        self.loads = [r.running + r.waiting for r in reports]
        self._busy = any(self.loads)
        snapshot = self.batcher.metrics()  # rank 0's, with the queue and running of all
        snapshot["queue_length"] = sum(r.waiting for r in reports)
        snapshot["running"] = sum(r.running for r in reports)
        snapshot["ranks"] = [r.metrics for r in reports]
        with self._lock:
            self._metrics = snapshot

    def _fail_all(self, message: str, status: int = 500) -> None:
        for request in self.requests.values():
            request.push(Update("", 0, "abort", error=message, status=status))
        self.requests.clear()
        self.rank_of.clear()


def _broadcast(orders: Orders | None, group: dist.ProcessGroup | None) -> Orders:
    """Rank 0's orders to every rank (the others pass None and get them)."""
    box: list[Any] = [orders]
    first = 0 if group is None else dist.get_global_rank(group, 0)
    try:
        dist.broadcast_object_list(box, src=first, group=group)
    except RuntimeError as e:  # a peer died or timed out: one line
        rank = dist.get_rank(group)
        raise PwctlError(f"rank {rank}: the serving orders did not arrive ({e})") from None
    return box[0]
