"""One forward pass of a scheduled batch: every scheduled token in one packed row with its own
position, attention through `pwctl_paged` (runtime/attention.py), logits only at the last token
of the sequences that sample this step."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from pwctl.runtime.attention import (
    ATTN_NAME,
    VARYING_SHAPE_SDPA,
    PagedBatch,
    SeqSpan,
    attention_implementation,
)
from pwctl.runtime.decode_graphs import DecodeGraphs
from pwctl.runtime.kv_cache import KVCache
from pwctl.runtime.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv: KVCache,
        device: str | torch.device = "cpu",
        graphs: DecodeGraphs | None = None,
    ):
        """`graphs`: runs the steps it fits (every sequence decoding), CUDA graphs replayed."""
        self.model, self.kv, self.device, self.graphs = model, kv, torch.device(device), graphs

    def inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
        """Packed input ids and positions [1, T], and the attention metadata."""
        ids, pos, slots, spans, start = [], [], [], [], 0
        for seq, n in zip(batch.seqs, batch.n_tokens, strict=True):
            past = seq.num_computed
            ids.extend(seq.all_ids[past : past + n])
            pos.extend(range(past, past + n))
            kv_slots = self.kv.slots(seq.seq_id, 0, past + n)  # host: located once a step
            slots.append(kv_slots[past:])
            spans.append(SeqSpan(start, start + n, past, kv_slots))
            start += n
        dev = self.device
        paged = PagedBatch(self.kv, torch.cat(slots).to(dev), spans)
        return torch.tensor([ids], device=dev), torch.tensor([pos], device=dev), paged

    @torch.no_grad()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [n, vocab] (fp32) for the sequences that sample, in batch order."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.forward(batch)
        ids, pos, paged = self.inputs(batch)
        keep = [s.q_stop - 1 for s, on in zip(paged.spans, batch.sampling, strict=True) if on]
        if not keep:
            keep = [ids.shape[1] - 1]  # prefill chunks only: still run the layers
        with attention_implementation(self.model, ATTN_NAME), sdpa_kernel(VARYING_SHAPE_SDPA):
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=False,
                logits_to_keep=torch.tensor(keep, device=self.device),
                pwctl_batch=paged,
            )
        logits = out.logits[0].float()
        return logits if any(batch.sampling) else logits[:0]
