"""The 16-bit expert backend: the pack's reference weights, stacked per layer on the device, run
as two grouped GEMMs over the (token, expert) pairs sorted by expert. This is the engine's FP16
baseline (`--policy fp16`): the same scheduler, KV cache, attention, sampler and decode graphs
as the paged policies, with experts a serious 16-bit engine would run (vLLM's fused MoE sorts
pairs by expert the same way).

Every step of a call stays on the device (the pairs sorted as the fused MoE sorts them:
`pairs.sort_by_expert`), so no call syncs the host and a decode step replays from a CUDA
graph. `torch._grouped_mm` runs its fused kernel for bf16 on Hopper (torch 2.11); for fp16 it
falls back to a loop that reads the offsets on the host, so on CUDA this backend runs in bf16
(the same bytes as fp16) and the engine runs the whole model in bf16 with it. On the CPU it
runs in the engine's dtype (the reference path's float32): the CPU twin the tests compare with
the store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.format.recipe import MoESpec
from pwctl.runtime.moe.activation import ExpertBias, glu_of
from pwctl.runtime.moe.pairs import sort_by_expert


def dense_dtype(device: str) -> torch.dtype:
    """The dtype the 16-bit experts (and the model around them) run in on `device`."""
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


class DenseLayer:
    """One MoE layer's experts: gate and up stacked [E, 2I, H] (read as [E, H, 2I]), down
    [E, H, I] (read as [E, I, H]), and the shared expert's, if any, as plain matrices."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, shared: tuple | None):
        self.gate_up, self.down, self.shared = gate_up, down, shared
        self.inter = down.shape[2]

    @property
    def nbytes(self) -> int:
        tensors = [self.gate_up, self.down, *(self.shared or ())]
        return sum(t.numel() * t.element_size() for t in tensors)


class DenseExperts:
    def __init__(self, pack: Pack, device: str, dtype: torch.dtype):
        spec = MoESpec(**pack.manifest.spec)
        self.spec, self.device, self.dtype = spec, device, dtype
        self.glu = glu_of(spec)
        reference = pack.reference()
        index = pack.index

        def weight(layer: int, expert: int, proj: str) -> torch.Tensor:
            block = pack.blocks[index[(layer, expert, proj)]]
            return reference[block.name].to(device, dtype)

        self.layers: dict[int, DenseLayer] = {}
        for layer in pack.manifest.moe_layers:
            experts = range(spec.num_experts)
            gate_up = torch.stack(
                [torch.cat([weight(layer, e, "gate"), weight(layer, e, "up")]) for e in experts]
            )
            down = torch.stack([weight(layer, e, "down") for e in experts])
            shared = None
            if spec.has_shared:
                e = spec.num_experts
                shared = (torch.cat([weight(layer, e, "gate"), weight(layer, e, "up")]),
                          weight(layer, e, "down"))  # fmt: skip
            self.layers[layer] = DenseLayer(gate_up, down, shared)

    @property
    def nbytes(self) -> int:
        """Device bytes of every layer's 16-bit experts."""
        return sum(layer.nbytes for layer in self.layers.values())

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        index: torch.Tensor,
        shared_scale: torch.Tensor | None = None,
        bias: ExpertBias | None = None,
    ) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{index[t, k]}(x[t]) (+ the shared expert) [T, H],
        with the routed experts' `bias` where the recipe has them."""
        d = self.layers.get(layer)
        if d is None:
            raise PwctlError(f"layer {layer} has no dense experts")
        xd = x.to(self.dtype)
        T, k = index.shape
        order, _, ends = sort_by_expert(index, self.spec.num_experts)
        tok, offs = order // k, ends.to(torch.int32)
        gu = torch._grouped_mm(xd[tok], d.gate_up.transpose(1, 2), offs=offs)
        expert = None if bias is None else index.reshape(-1)[order]  # no gather without biases
        if bias is not None:
            gu = gu + torch.cat([bias.gate, bias.up], dim=-1)[expert].to(gu.dtype)
        h = self.glu(gu[:, : d.inter], gu[:, d.inter :])
        y = torch._grouped_mm(h, d.down.transpose(1, 2), offs=offs)
        if bias is not None:
            y = y + bias.down[expert].to(y.dtype)
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros(T, x.shape[1], device=x.device, dtype=y.dtype)
        out.index_add_(0, tok, y)
        if d.shared is not None:
            gate_up, down = d.shared
            g = F.linear(xd, gate_up)
            i = down.shape[1]
            s = F.linear(self.glu(g[:, :i], g[:, i:]), down)
            out = out + (s if shared_scale is None else shared_scale.to(s.dtype) * s)
        return out
