"""Decode steps replayed from CUDA graphs.

An eager decode step launches a few hundred small GPU ops from Python, and at batch 1 the host
takes 7-10x the GPU's time (docs/decisions/036-decode-cuda-graphs.md). A step whose every
sequence decodes one token has a shape fixed by two numbers, so its whole model forward is
captured once per shape and replayed:

- S, the sequences, rounded up to a bucket (1, 2, 4, 8, ... up to max_seqs). Padding rows repeat
  the last real row: same token, position and cache rows, so they compute and write the same
  keys and values to the same place, and their logits are dropped.
- L, the cache rows a row attends to, rounded up to a power of two of KV blocks (at least
  MIN_BLOCKS). Each row's block table is padded with its own first block and its rows past its
  length read its first row, masked out (`DecodeBatch`).

The inputs (token ids, positions, block tables) go through one device buffer per (S, L), filled
by one host-to-device copy a step; lengths and the new tokens' cache rows follow from them on the
device.
The MoE kernels a layer launches depend on the widths the pager left it (`FusedMoE.decode_builds`):
any build reads any width, so a graph stays correct when widths change, but it is re-captured
for the builds of the widths in use, keyed by them. Graphs share one memory pool (steps replay
one at a time) and the least recently used go past `max_graphs`.

Without capture (`capture=False`, the CPU), the same fixed-shape forward runs eagerly: what the
tests compare with the packed-row path (runner.py) and what a graph replays.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pwctl.runtime.engine.attention import ATTN_NAME, DecodeBatch, attention_implementation
from pwctl.runtime.engine.scheduler import ScheduledBatch
from pwctl.runtime.memory.accounting import probe_ids
from pwctl.runtime.memory.kv_cache import KVCache
from pwctl.runtime.moe.block import MoEBlock, MoETap

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)
MIN_BLOCKS = 4  # the shortest L bucket, in KV blocks


def bucket(n: int, top: int | None = None) -> int:
    """The smallest power of two >= n, at most `top` (n <= top)."""
    p = 1 << (n - 1).bit_length()
    return p if top is None else min(p, top)


@dataclass(frozen=True)
class DeviceTokens:
    """The last step's sampled tokens, still on the device: `tokens` [n] and the row of each
    sequence id in it (an overlapped step reads its sequences' newest tokens there)."""

    tokens: torch.Tensor
    rows: dict[int, int]


@dataclass
class DecodeInputs:
    """A fixed-shape step's inputs for S rows over L cache rows (nb = L / block_size blocks),
    views of one int64 device buffer that one copy from a host twin fills. A row's token sits
    at its position, so the row's length is position + 1. A row whose token is still on the
    device has its row in the last step's tokens under `src` (else -1), and takes it there.
    Two host twins take turns: a step fills one while the copy of the step before, queued from
    the other, may not have run yet (overlapped steps sync only on the step before that)."""

    hosts: tuple[torch.Tensor, torch.Tensor]
    device: torch.Tensor
    S: int
    nb: int
    turn: int = 0

    @classmethod
    def new(cls, S: int, nb: int, device: torch.device) -> DecodeInputs:
        n, pin = S * (3 + nb), device.type == "cuda"
        hosts = tuple(torch.zeros(n, dtype=torch.long, pin_memory=pin) for _ in range(2))
        return cls(hosts, torch.zeros(n, dtype=torch.long, device=device), S, nb)  # type: ignore[arg-type]  # two

    @property
    def host(self) -> torch.Tensor:
        """The host twin the next fill writes."""
        return self.hosts[self.turn]

    def views(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ids [1, S], positions [1, S], src [S], blocks [S, nb]."""
        S = self.S
        return (t[:S].view(1, S), t[S : 2 * S].view(1, S), t[2 * S : 3 * S],
                t[3 * S :].view(S, self.nb))  # fmt: skip

    def fill(self, kv: KVCache, batch: ScheduledBatch, fed: DeviceTokens | None = None) -> None:
        """This step's values, padding rows repeating the last real one; one copy to the device
        (non-blocking), then the tokens still on the device gathered from `fed`."""
        host = self.host
        self.turn ^= 1
        ids, pos, src, blocks = (v.numpy() for v in self.views(host))
        for i, seq in enumerate(batch.seqs):
            past = seq.num_computed
            table = kv.table_array(seq.seq_id)[: self.nb]
            token = seq.token_at(past)
            if token is None:
                if fed is None:
                    raise ValueError(f"sequence {seq.seq_id}: its newest token is on the device")
                ids[0, i], src[i] = 0, fed.rows[seq.seq_id]
            else:
                ids[0, i], src[i] = token, -1
            pos[0, i] = past
            blocks[i, : len(table)] = table
            blocks[i, len(table) :] = table[0]
        n = len(batch.seqs)
        for v in (ids[0], pos[0], src, blocks):
            v[n:] = v[n - 1]
        self.device.copy_(host, non_blocking=self.device.is_cuda)
        if fed is not None and (src[:n] >= 0).any():
            d_ids, _, d_src, _ = self.views(self.device)
            picked = fed.tokens[d_src.clamp(min=0)]
            d_ids[0].copy_(torch.where(d_src >= 0, picked, d_ids[0]))


def cache_rows(
    kv: KVCache, blocks: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Of rows with block tables [S, nb] and lengths [S]: the cache rows they attend to [S, nb x
    block_size] (rows at and past a row's length repeat its first: written, so finite; masked
    out), and the cache row of each one's new token [S] (at length - 1)."""
    pos = torch.arange(blocks.shape[1] * kv.block_size, device=blocks.device)
    rows = kv.block_rows(blocks, pos)
    new = rows.gather(1, (lengths - 1)[:, None])[:, 0]
    return torch.where(pos[None, :] < lengths[:, None], rows, rows[:, :1]), new


class DecodeGraphs:
    def __init__(
        self,
        model: PreTrainedModel,
        kv: KVCache,
        max_seqs: int,
        builds: Callable[[int], tuple] | None = None,
        capture: bool = True,
        max_graphs: int = 32,
    ):
        """`builds(T)`: the MoE kernels a decode call of T tokens launches now (None: nothing
        host-chosen, e.g. the torch path). `capture`: replay CUDA graphs (else run eagerly)."""
        self.model, self.kv, self.max_seqs = model, kv, max_seqs
        self.builds, self.capture, self.max_graphs = builds, capture, max_graphs
        self.device = next(model.parameters()).device
        self.blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
        self._inputs: dict[tuple[int, int], DecodeInputs] = {}
        self._graphs: OrderedDict[tuple, torch.cuda.CUDAGraph] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # what every graph writes, made on the first capture: logits [max_seqs, vocab] (fp32),
        # and per MoE layer the tap's tensors (x, index, weights; max_seqs rows)
        self._logits: torch.Tensor | None = None
        self._seen: dict[int, tuple[torch.Tensor, ...]] = {}
        self.captures = 0  # graphs captured so far (re-captures included)
        self.capture_s = 0.0  # host seconds those captures took (a fresh shape's first step)
        self.replays = 0
        self.disabled: str | None = None  # why capture failed, if it did: steps run eagerly

    def fits(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` is a step this runs: every sequence decodes one token and samples."""
        return (
            self.disabled is None
            and 0 < len(batch.seqs) <= self.max_seqs
            and all(n == 1 for n in batch.n_tokens)
            and all(batch.sampling)
        )

    def forward(self, batch: ScheduledBatch, fed: DeviceTokens | None = None) -> torch.Tensor:
        """Logits [S, vocab] (fp32) of the batch's sequences, in batch order; `fed`: the last
        step's tokens, where the host has not read them yet."""
        S, kv = len(batch.seqs), self.kv
        longest = max(s.num_computed + 1 for s in batch.seqs)
        Sb = bucket(S, self.max_seqs)
        nb = max(MIN_BLOCKS, bucket(kv.blocks_for(longest)))
        if (Sb, nb) not in self._inputs:
            self._inputs[(Sb, nb)] = DecodeInputs.new(Sb, nb, self.device)
        inputs = self._inputs[(Sb, nb)]
        inputs.fill(kv, batch, fed)
        tap = self._tap()
        if self.capture and self._replay(inputs, tap):
            logits, seen = self._logits, self._seen
        else:
            logits, seen = self._run(inputs).float(), dict(tap.seen) if tap is not None else {}
        assert logits is not None  # a replay wrote the graphs' outputs
        if tap is not None:  # the policy's signals: the real rows only
            tap.seen = {layer: tuple(t[:S] for t in v) for layer, v in seen.items()}
        return logits[:S]

    def largest_step(self, table: list[int], length: int) -> None:
        """Run the largest decode step (a graph captured and replayed where graphs are on), for
        its memory's sake: `max_seqs` rows, each `length` tokens long over one block table
        `table` (the engine's start-up; every row writes the same cache row)."""
        nb = max(MIN_BLOCKS, bucket(self.kv.blocks_for(length)))
        inputs = DecodeInputs.new(self.max_seqs, nb, self.device)
        ids, pos, src, blocks = inputs.views(inputs.host)
        src.fill_(-1)
        vocab = self.model.config.vocab_size
        ids.copy_(probe_ids(vocab, tuple(ids.shape)))
        pos.fill_(length - 1)
        blocks[:] = table[0]
        blocks[:, : min(nb, len(table))] = torch.tensor(table[:nb])
        inputs.device.copy_(inputs.host)
        if not (self.capture and self._replay(inputs, None)):
            self._run(inputs)

    def _tap(self) -> MoETap | None:
        observer = self.blocks[0].observer if self.blocks else None
        if observer is not None and not isinstance(observer, MoETap):
            raise TypeError("decode graphs record a MoETap's signals, not other observers")
        return observer

    def _run(self, inputs: DecodeInputs) -> torch.Tensor:
        """The model forward of a fixed-shape decode step (what a graph captures)."""
        ids, pos, _, blocks = inputs.views(inputs.device)
        lengths = pos[0] + 1
        table, slots = cache_rows(self.kv, blocks, lengths)
        keep = torch.arange(inputs.S, device=ids.device)
        with attention_implementation(self.model, ATTN_NAME), torch.no_grad():
            out = self.model(
                input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep,
                pwctl_batch=DecodeBatch(self.kv, slots, table, lengths),
            )  # fmt: skip
        return out.logits[0]

    def _replay(self, inputs: DecodeInputs, tap: MoETap | None) -> bool:
        """Replay the graph of these inputs' shape and today's builds (captured if new); False
        when a capture fails (the step then runs eagerly, as every later one does)."""
        builds = self.builds(inputs.S) if self.builds is not None else ()
        key = (inputs.S, inputs.nb, builds, tap is not None)
        if key not in self._graphs:
            start = time.perf_counter()
            try:
                self._graphs[key] = self._capture(inputs, tap)
            except Exception as e:  # an op that syncs or reads the host: step eagerly from now
                self.disabled = f"{type(e).__name__}: {e}"
                log.warning("decode steps run eagerly: capturing one failed (%s)", self.disabled)
                return False
            self.capture_s += time.perf_counter() - start
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        self._graphs[key].replay()
        self.replays += 1
        return True

    def _capture(self, inputs: DecodeInputs, tap: MoETap | None) -> torch.cuda.CUDAGraph:
        """A graph of `_run` on `inputs` writing into the shared outputs, after one eager run
        (which makes the kernels' lazily built launches and buffers, and the outputs: a capture
        records work, it runs none). Graphs share one memory pool and keep nothing of their own
        there: a step's temporaries are dead when its replay ends. The eager run is on the
        serving stream, not a side stream: the caching allocator keeps a stream's blocks for
        that stream, so the buffers the run makes for good (the fused MoE's, per token count)
        would pin pages of a segment only captures use. That is the likely holder of what was
        reserved and not allocated on an H100 (2026-12-06: ~108 MB at start-up, rises of 65-78
        MB with new graph shapes); the peak timeline's `where` (by stream) tells."""
        logits = self._run(inputs)  # the step itself: the replay rewrites the same cache rows
        torch.cuda.current_stream().synchronize()
        torch.cuda.empty_cache()  # that run's temporaries, before the graph's pool takes its own
        self._make_outputs(logits, tap)
        graph = torch.cuda.CUDAGraph()
        S = inputs.S
        with torch.cuda.graph(graph, pool=self._pool):
            self._logits[:S].copy_(self._run(inputs))  # type: ignore[index]  # _make_outputs
            for layer, values in (tap.seen if tap is not None else {}).items():
                for out, value in zip(self._seen[layer], values, strict=True):
                    out[:S].copy_(value)
        self.captures += 1
        return graph

    def _make_outputs(self, logits: torch.Tensor, tap: MoETap | None) -> None:
        n = self.max_seqs
        if self._logits is None:
            self._logits = torch.empty(n, logits.shape[-1], device=logits.device)
        for layer, values in (tap.seen if tap is not None else {}).items():
            if layer not in self._seen:
                self._seen[layer] = tuple(v.new_empty(n, *v.shape[1:]) for v in values)

    def stats(self) -> dict[str, float]:
        return {"decode_graphs": len(self._graphs), "decode_graph_captures": self.captures,
                "decode_graph_capture_s": round(self.capture_s, 3),
                "decode_graph_replays": self.replays}  # fmt: skip
