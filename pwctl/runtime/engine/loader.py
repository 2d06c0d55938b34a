"""Build a runnable model from a pack: transformers' own code for everything but the MoE blocks.

The model is built on the meta device (so dense experts are never materialised), every MoE block
is swapped for `MoEBlock`, and the non-expert weights are assigned from the pack. On one rank's
share of a pack (parallel/rank_pack.py) the MoE blocks run their own experts only until the ranks
join (nothing the engine runs before then reads another rank's vacant blocks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.format.recipe import MoESpec, load_recipe
from pwctl.runtime.memory.expert_store import ExpertStore
from pwctl.runtime.moe.block import DenseMLP, MoEBlock
from pwctl.runtime.moe.router import ResidualRouter
from pwctl.runtime.parallel.rank_pack import exchange_before_join

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_model(
    pack: Pack, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, ExpertStore]:
    from transformers import AutoConfig, AutoModelForCausalLM

    m = pack.manifest
    recipe = load_recipe(m.model_type)
    spec = MoESpec(**m.spec)
    config = AutoConfig.from_pretrained(pack.path, local_files_only=True)
    store = ExpertStore(pack, device, dtype)
    exchange = exchange_before_join(pack)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        for layer in m.moe_layers:
            parent, attr = recipe.moe_path(layer).rsplit(".", 1)
            block = MoEBlock(spec, layer, store, recipe.moe_returns == "tuple")
            block.exchange = exchange
            setattr(model.get_submodule(parent), attr, block)
            dense = recipe.dense_path(layer)
            if dense is not None and spec.has_dense:  # its blocks, on the block's backend
                parent, attr = dense.rsplit(".", 1)
                setattr(model.get_submodule(parent), attr, DenseMLP(block))
            router = recipe.router_path(layer)
            if router is not None:  # a router of its own (Gemma-4): the layer hands its choice on
                parent, attr = router.rsplit(".", 1)
                setattr(model.get_submodule(parent), attr, ResidualRouter(spec))
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in pack.nonexpert().items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise PwctlError(
            f"{pack.path}: non-expert tensors the model does not have: {result.unexpected_keys[:5]}"
        )
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    _rebuild_meta_buffers(model)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise PwctlError(f"{pack.path}: pack lacks weights for {missing[:5]}")
    return model.to(device).eval(), store


def _rebuild_meta_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary inv_freq) were computed on meta: rebuild their modules."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if hasattr(module, "scalar_embed_scale"):  # Gemma's scaled embeddings: one scalar
                module.embed_scale = torch.tensor(float(module.scalar_embed_scale))
                continue
            if not hasattr(module, "config"):
                raise PwctlError(f"cannot rebuild buffers of {name} ({type(module).__name__})")
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, type(module)(module.config))
