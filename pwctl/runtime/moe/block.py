"""The MoE block pwctl puts in place of each transformers MoE block: routing per recipe, routed
experts, the shared expert and its gate, weighted combine. Two execution backends: the
ExpertStore (CPU reference, dequantized weights per width; routed here with `route`) and, once
the engine installs one in `paged`, PagedExperts, whose fused MoE takes the router weights too
(`FusedMoE.routed`: on CUDA decode one launch routes and prepares the kernels; on the CPU
`route` and the same pairs in torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pwctl.format.recipe import MoESpec
from pwctl.runtime.memory.expert_store import ExpertStore
from pwctl.runtime.moe.activation import ExpertBias
from pwctl.runtime.moe.prep import can_route
from pwctl.runtime.moe.router import route

if TYPE_CHECKING:
    from pwctl.runtime.memory.paged_experts import PagedExperts
    from pwctl.runtime.moe.dense_experts import DenseExperts
    from pwctl.runtime.parallel.exchange import ExpertExchange


class BiasHolder(nn.Module):
    """The routed experts' 16-bit biases under transformers' names (`experts.gate_up_proj_bias`
    [E, 2I], `experts.down_proj_bias` [E, H]): non-expert tensors of the pack, never planes."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(spec.num_experts, 2 * spec.intermediate))
        self.down_proj_bias = nn.Parameter(torch.zeros(spec.num_experts, spec.hidden))
        self.interleaved = spec.gate_up_interleaved

    def split(self) -> ExpertBias:
        gu = self.gate_up_proj_bias
        gate, up = (gu[:, 0::2], gu[:, 1::2]) if self.interleaved else gu.chunk(2, dim=-1)
        return ExpertBias(gate, up, self.down_proj_bias)


class MoEBlock(nn.Module):
    # parameter names match transformers' in-memory layout, so non-expert weights load as-is
    def __init__(self, spec: MoESpec, layer: int, store: ExpertStore, returns_tuple: bool = False):
        """`returns_tuple`: the decoder layer unpacks (hidden, router scores) (recipe
        moe_returns; the scores are None: nothing reads them at inference)."""
        super().__init__()
        self.spec, self.layer, self.store = spec, layer, store
        self.returns_tuple = returns_tuple
        # no gate where the router is a module of its own (spec.own_router: it hands its choice in)
        self.gate = (
            None
            if spec.own_router
            else nn.Linear(spec.hidden, spec.num_experts, bias=spec.router_bias)
        )
        self.shared_expert_gate = (
            nn.Linear(spec.hidden, 1, bias=False) if spec.shared_gate else None
        )
        self.experts = BiasHolder(spec) if spec.expert_bias else None
        # profile's tap: called as observer(layer, x [T, H], index [T, k], weights [T, k])
        self.observer: MoETap | None = None
        self.paged: PagedExperts | None = None  # set by the engine: the paged backend
        self.dense: DenseExperts | None = None  # or the 16-bit experts (fp16 policy)
        # expert parallel (runtime/parallel): routed experts run on their owners' ranks
        self.exchange: ExpertExchange | None = None

    def shared_scale(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's gate per token [T, 1] (None: ungated or no shared expert)."""
        if self.shared_expert_gate is None:
            return None
        return torch.sigmoid(self.shared_expert_gate(x))

    def bias(self) -> ExpertBias | None:
        """The routed experts' biases (None: the recipe has none)."""
        return None if self.experts is None else self.experts.split()

    def forward(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, None]:
        out = self.moe(hidden, top_k_index, top_k_weights)
        return (out, None) if self.returns_tuple else out

    def moe(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The experts' sum for `hidden` [..., H] (what `forward` returns, or its first): routed
        here, or as `top_k_index` / `top_k_weights` [T, k] say (the router module of its own,
        spec.own_router, passes its pick; bench replays a recorded one)."""
        x = hidden.reshape(-1, self.spec.hidden)
        if top_k_index is not None and top_k_weights is not None:
            return self._chosen(hidden, x, top_k_weights.float(), top_k_index)
        if self.gate is None:
            raise RuntimeError("this MoE block's router is a module of its own: pass its pick")
        # the fused router-in-the-kernel call runs every expert here: not with an exchange
        fused = self.paged.fused if self.paged is not None and self.exchange is None else None
        if fused is not None and can_route(self.spec, x, self.gate.weight):
            sg = self.shared_expert_gate  # router, grouping and layout in one launch
            sgw = None if sg is None else sg.weight
            bias = self.gate.bias, self.bias()  # (GPT-OSS: the router's, the experts')
            out, routing = fused.routed(self.layer, x, self.gate.weight, sgw, *bias)
            if self.observer is not None:  # routing's buffers are reused by the next layer
                self.observer(self.layer, x, routing.index, routing.weights, reused=True)
            return out.to(x.dtype).view_as(hidden)
        weights, index = route(self.gate(x), self.spec)
        return self._chosen(hidden, x, weights, index)

    def _chosen(
        self, hidden: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """The experts of the routing chosen, on whichever backend is installed."""
        if self.observer is not None:
            self.observer(self.layer, x, index, weights)
        if self.exchange is not None:  # routed experts on their owners, the shared one here
            out = self.exchanged(x, weights, index).to(x.dtype)
            return self._add_shared(x, out).view_as(hidden)
        if self.paged is not None:
            out = self.paged.fused(
                self.layer, x, weights, index, self.shared_scale(x), bias=self.bias()
            )
            return out.to(x.dtype).view_as(hidden)
        if self.dense is not None:
            out = self.dense(self.layer, x, weights, index, self.shared_scale(x), self.bias())
            return out.to(x.dtype).view_as(hidden)
        return self._store_forward(x, weights, index).view_as(hidden)

    def exchanged(
        self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """Routed experts through the exchange (float32 [T, H]): this rank runs what the others
        (and it) send to the experts it owns, on its backend (the paged one's fused MoE takes
        them in one call; else the store, an expert at a time). A rank with no tokens calls it
        with T = 0: it still serves the others."""
        assert self.exchange is not None
        bias = self.bias()
        paged = self.paged

        def run(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
            ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
            if paged is not None:
                return paged.fused(
                    self.layer, rows, ones, experts[:, None], bias=bias, routed_only=True
                )
            return self._store_routed(rows, ones, experts[:, None]).float()

        return self.exchange(self.layer, x, weights, index, run)

    def _store_forward(
        self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        return self._add_shared(x, self._store_routed(x, weights, index))

    def _store_routed(
        self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighted sum on the store, an expert at a time ([T, H], x's
        dtype)."""
        out = torch.zeros_like(x)
        bias = self.bias()
        for e in index.unique().tolist():
            tokens, slot = torch.where(index == e)
            b = None if bias is None else bias.of(e)
            y = self.store.mlp(self.layer, e, x[tokens], b) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus the shared expert's output (gated where the recipe gates it), if any."""
        if not self.spec.has_shared:
            return out
        shared = self.store.mlp(self.layer, self.spec.num_experts, x)
        scale = self.shared_scale(x)
        return out + (shared if scale is None else scale * shared)


class DenseMLP(nn.Module):
    """A dense MLP every token runs beside the experts (spec.has_dense: Gemma-4's), computed from
    its blocks in the shared expert's slot on the backend its layer's MoEBlock has."""

    def __init__(self, block: MoEBlock):
        super().__init__()
        self._block = (block,)  # a tuple: not a submodule (the layer holds the block already)
        self.layer = block.layer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.moe(hidden)

    def moe(self, hidden: torch.Tensor, *unrouted: None) -> torch.Tensor:
        """The MLP's output for `hidden` [..., H]; `unrouted`: the routing MoEBlock.moe takes
        (bench calls both alike), always None."""
        b = self._block[0]
        x = hidden.reshape(-1, b.spec.hidden)
        if b.observer is not None:
            b.observer.dense_input(b.layer, x)
        if b.paged is not None:
            out = b.paged.fused.dense(b.layer, x)
        elif b.dense is not None:
            raise RuntimeError("the 16-bit experts have no dense MLP: use the store or planes")
        else:
            out = b.store.mlp(b.layer, b.spec.num_experts, x)
        return out.to(x.dtype).view_as(hidden)


class MoETap:
    """Context manager recording each MoE block's input and routing during a forward pass
    (profile's features and proxy, bench's MoE output error)."""

    def __init__(self, model: nn.Module, inputs: bool = True, weights: bool = True):
        """`inputs`, `weights`: whether the blocks' inputs and routing weights are kept; where
        not, `seen` holds empty [T, 0] views in their place, which a decode graph copies at no
        cost (the serving planner reads the routing alone unless it fits a residual; a decode
        graph copied all three, per MoE layer, into its outputs at every step)."""
        self.blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
        self.inputs, self.weights = inputs, weights
        self.seen: dict[int, tuple[torch.Tensor, ...]] = {}  # (x, index, weights)
        self.dense_seen: dict[int, torch.Tensor] = {}  # a dense MLP's input (DenseMLP)

    def __call__(
        self, layer: int, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
        reused: bool = False,
    ) -> None:  # fmt: skip
        """`reused`: `index` and `weights` sit in buffers the next layer overwrites (the fused
        path's routing): what is kept is copied."""
        x = x.detach() if self.inputs else x[:, :0]
        weights = (weights.clone() if reused else weights) if self.weights else weights[:, :0]
        self.seen[layer] = (x, index.clone() if reused else index, weights)

    def dense_input(self, layer: int, x: torch.Tensor) -> None:
        self.dense_seen[layer] = x.detach()

    def __enter__(self) -> MoETap:
        self._observe(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._observe(None)

    def _observe(self, observer: MoETap | None) -> None:
        """Every block's observer, set as a plain attribute: nn.Module's __setattr__ (it checks
        for parameters, buffers and submodules first) took 170 us for 48 layers in and out on
        the dev VM (19 us plain), and a dynamic policy's serving loop enters and leaves a tap
        every step."""
        for m in self.blocks:
            object.__setattr__(m, "observer", observer)
