"""One forward pass of a scheduled batch: every scheduled token in one packed row with its own
position, attention through `pwctl_paged` (attention.py), logits only at the last token
of the sequences that sample this step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.nn.attention import sdpa_kernel

from pwctl.runtime.engine.attention import (
    ATTN_NAME,
    VARYING_SHAPE_SDPA,
    PagedBatch,
    SeqSpan,
    attention_implementation,
)
from pwctl.runtime.engine.decode_graphs import DecodeGraphs, DeviceTokens
from pwctl.runtime.engine.scheduler import ScheduledBatch
from pwctl.runtime.memory.accounting import probe_ids
from pwctl.runtime.memory.kv_cache import KVCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

WARM_UP_SEQ = -1  # the KV cache's sequence id for `probe_sequence` (requests count from 0)


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        kv: KVCache,
        device: str | torch.device = "cpu",
        graphs: DecodeGraphs | None = None,
    ):
        """`graphs`: runs the steps it fits (every sequence decoding), CUDA graphs replayed."""
        self.model, self.kv, self.device, self.graphs = model, kv, torch.device(device), graphs

    def inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
        """Packed input ids and positions [1, T], and the attention metadata (every token on
        the host)."""
        ids, pos, slots, spans, start = [], list[int](), [], [], 0
        for seq, n in zip(batch.seqs, batch.n_tokens, strict=True):
            past = seq.num_computed
            if seq.pending:
                raise ValueError(f"sequence {seq.seq_id}: its newest token is on the device")
            ids.extend(seq.ids(past, past + n))
            pos.extend(range(past, past + n))
            kv_slots = self.kv.slots(seq.seq_id, 0, past + n)  # host: located once a step
            slots.append(kv_slots[past:])
            spans.append(SeqSpan(start, start + n, past, kv_slots))
            start += n
        dev = self.device
        paged = PagedBatch(self.kv, torch.cat(slots).to(dev), spans)
        return torch.tensor([ids], device=dev), torch.tensor([pos], device=dev), paged

    def takes_device_tokens(self, batch: ScheduledBatch) -> bool:
        """Whether `forward` can read the batch's newest tokens on the device (a decode step
        the graphs run); the packed rows need every token on the host."""
        return self.graphs is not None and self.graphs.fits(batch)

    @torch.no_grad()
    def forward(self, batch: ScheduledBatch, fed: DeviceTokens | None = None) -> torch.Tensor:
        """Logits [n, vocab] (fp32) for the sequences that sample, in batch order. `fed`: the
        last step's tokens the host has not read (only where `takes_device_tokens`)."""
        if self.takes_device_tokens(batch):
            assert self.graphs is not None  # takes_device_tokens
            return self.graphs.forward(batch, fed)
        ids, pos, paged = self.inputs(batch)
        keep = [s.q_stop - 1 for s, on in zip(paged.spans, batch.sampling, strict=True) if on]
        logits = self._packed(ids, pos, paged, keep)
        return logits if any(batch.sampling) else logits[:0]

    def _packed(
        self, ids: torch.Tensor, pos: torch.Tensor, paged: PagedBatch, keep: list[int]
    ) -> torch.Tensor:
        """Logits [len(keep), vocab] (fp32) of packed rows `keep` (none: the last row's, so
        a step of prefill chunks only still runs the layers)."""
        keep = keep or [ids.shape[1] - 1]
        with attention_implementation(self.model, ATTN_NAME), sdpa_kernel(VARYING_SHAPE_SDPA):
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=False,
                logits_to_keep=torch.tensor(keep, device=self.device),
                pwctl_batch=paged,
            )
        return out.logits[0].float()

    @contextmanager
    def probe_sequence(self, max_len: int) -> Iterator[torch.Tensor]:
        """One full-length sequence's cache rows for the start-up's step runs (every row they
        read and write is one of them), given back after."""
        if not self.kv.grow(WARM_UP_SEQ, max_len):
            raise RuntimeError(f"warm-up: no room in the KV cache for {max_len} tokens")
        try:
            yield self.kv.slots(WARM_UP_SEQ, 0, max_len)
        finally:
            self.kv.free(WARM_UP_SEQ)

    @torch.no_grad()
    def largest_eager_step(
        self, rows: torch.Tensor, max_seqs: int, max_batch_tokens: int, max_len: int
    ) -> None:
        """Run the largest eager step the scheduler can form, for its memory's sake (the
        engine measures what it holds at start-up): every decode row but one over a full-length
        cache, beside a prefill chunk of the remaining tokens at the end of a full-length
        sequence, all on `rows` (`probe_sequence`). The token ids are random from a fixed seed
        (`probe_ids`), so every process that measures this step allocates alike."""
        decodes = max(0, min(max_seqs, max_batch_tokens) - 1)
        n = max(1, min(max_batch_tokens - decodes, max_len))
        spans = [SeqSpan(i, i + 1, max_len - 1, rows) for i in range(decodes)]
        spans.append(SeqSpan(decodes, decodes + n, max_len - n, rows))
        slots = torch.cat([rows[-1:].repeat(decodes), rows[max_len - n :]])
        positions = [max_len - 1] * decodes + list(range(max_len - n, max_len))
        vocab = self.model.config.vocab_size
        dev = self.device
        ids = probe_ids(vocab, (1, decodes + n)).to(dev)
        paged = PagedBatch(self.kv, slots.to(dev), spans)
        self._packed(ids, torch.tensor([positions], device=dev), paged,
                     list(range(decodes)) + [decodes + n - 1])  # fmt: skip

    def largest_graph_step(self, max_len: int) -> None:
        """The largest decode graph, captured and replayed (their pool's share), over the
        probe sequence's blocks; nothing without graphs."""
        if self.graphs is not None:
            self.graphs.largest_step(self.kv.tables[WARM_UP_SEQ], max_len)
