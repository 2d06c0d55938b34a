"""Importance weights for the quantizer: E[x^2] per input channel of every block, measured on
calibration text with a forward pass of the source model (a forward-only stand-in for APL's
squared gradients).

Gate and up read the MoE input of the tokens routed to their expert; down reads that expert's
intermediate act(gate x) * up x. A rarely routed expert has a noisy estimate, so each expert's
mean is shrunk towards the layer's pooled mean with a prior worth PRIOR_TOKENS tokens.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pwctl.errors import PwctlError
from pwctl.format.recipe import MoESpec, Recipe
from pwctl.runtime.moe.activation import glu_of
from pwctl.text import token_windows

PRIOR_TOKENS = 16.0


@dataclass
class ChannelStats:
    sum_sq: torch.Tensor
    tokens: int = 0

    def add(self, x: torch.Tensor) -> None:
        self.sum_sq += x.float().pow(2).sum(0).cpu()
        self.tokens += x.shape[0]


@dataclass
class Importance:
    """Per (layer, expert): input-channel weights for gate/up ("in") and for down ("mid")."""

    stats: dict[tuple[int, int, str], ChannelStats]
    pooled: dict[tuple[int, str], ChannelStats]
    tokens: int

    def weights(
        self, layer: int, expert: int, kind: str, shared: bool
    ) -> tuple[torch.Tensor | None, int]:
        """Normalised weights (mean 1) and the tokens behind them; None means unweighted."""
        s = self.stats.get((layer, expert, kind))
        n = s.tokens if s else 0
        if shared:  # every token passes a shared expert: its own estimate needs no prior
            if s is None or n == 0:
                return None, 0
            w = s.sum_sq / n
        else:
            pool = self.pooled.get((layer, kind))
            if pool is None or pool.tokens == 0:
                return None, 0
            prior = pool.sum_sq / pool.tokens
            total = (s.sum_sq if s else torch.zeros_like(prior)) + PRIOR_TOKENS * prior
            w = total / (n + PRIOR_TOKENS)
        w = w / w.mean().clamp_min(1e-30)
        return w.clamp_min(1e-4), n


def collect(
    src: Path,
    recipe: Recipe,
    spec: MoESpec,
    moe_layers: list[int],
    calib: Path,
    device: str,
    seq_len: int = 512,
    max_tokens: int = 16384,
) -> Importance:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    except (OSError, ValueError) as e:
        raise PwctlError(f"{src}: --calib needs the checkpoint's tokenizer ({e})") from None
    extra: dict[str, Any] = {}
    quant = AutoConfig.from_pretrained(src, local_files_only=True).to_dict()
    if (quant.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        from transformers.utils.quantization_config import Mxfp4Config  # dequantized, no kernels

        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, local_files_only=True, **extra
    )
    model.to(device).eval()  # type: ignore[arg-type]  # transformers types `to` as a decorator
    stats: dict[tuple[int, int, str], ChannelStats] = {}
    pooled: dict[tuple[int, str], ChannelStats] = defaultdict(lambda: None)  # type: ignore
    hooks = []

    def acc(key, table, x, width):
        if key not in table or table[key] is None:
            table[key] = ChannelStats(torch.zeros(width))
        table[key].add(x)

    def mlp_hooks(mlp: Any, slot: tuple[int, int], inner: int) -> list:
        """Hooks pooling what an MLP every token runs (a shared expert, a dense MLP) reads: its
        input and its down's."""

        def mlp_in(m, a):
            acc((*slot, "in"), stats, a[0].flatten(0, -2), spec.hidden)

        def mlp_mid(m, a):
            acc((*slot, "mid"), stats, a[0].flatten(0, -2), inner)

        return [mlp.register_forward_pre_hook(mlp_in),
                mlp.down_proj.register_forward_pre_hook(mlp_mid)]  # fmt: skip

    glu = glu_of(spec)
    transposed = recipe.experts.get("transposed", False)  # GPT-OSS: [E, H, 2I], interleaved

    def expert_h(mod: Any, e: int, xe: torch.Tensor) -> torch.Tensor:
        """What expert e's down reads: glu(gate x, up x), biases and layout per the recipe."""
        w = mod.gate_up_proj[e]
        gu = xe @ w if transposed else F.linear(xe, w)
        if spec.expert_bias:
            gu = gu + mod.gate_up_proj_bias[e]
        if spec.gate_up_interleaved:
            return glu(gu[..., 0::2], gu[..., 1::2])
        gate, up = gu.chunk(2, dim=-1)
        return glu(gate, up)

    for layer in moe_layers:
        moe: Any = _module(model, recipe, recipe.moe_path(layer))
        experts = getattr(moe, "experts", moe)  # the MoE block, or the experts themselves

        def routed(mod, args, kwargs, layer=layer):
            x = args[0] if args else kwargs["hidden_states"]
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            acc((layer, "in"), pooled, x, spec.hidden)
            for e in idx.unique().tolist():
                xe = x[(idx == e).any(-1)]
                h = expert_h(mod, e, xe)
                acc((layer, e, "in"), stats, xe, spec.hidden)
                acc((layer, e, "mid"), stats, h, spec.intermediate)
                acc((layer, "mid"), pooled, h, spec.intermediate)

        hooks.append(experts.register_forward_pre_hook(routed, with_kwargs=True))
        if spec.has_shared:
            shared_path = ".".join(recipe.shared["down"].format(layer=layer).split(".")[:-2])
            shared: Any = model.get_submodule(shared_path)
            hooks += mlp_hooks(shared, (layer, spec.num_experts), spec.shared_intermediate)
        dense_path = recipe.dense_path(layer)
        if dense_path is not None and spec.has_dense:  # the dense MLP (the shared slot)
            dense: Any = _module(model, recipe, dense_path)
            hooks += mlp_hooks(dense, (layer, spec.num_experts), dense.down_proj.in_features)
    ids = token_windows(tok, calib, seq_len, max_tokens)
    with torch.no_grad():
        for row in ids:
            model(row[None].to(device))
    for h in hooks:
        h.remove()
    del model
    return Importance(stats, {k: v for k, v in pooled.items() if v is not None}, ids.numel())


def _module(model: Any, recipe: Recipe, path: str) -> Any:
    """transformers' module at `path` (a multimodal model's language model: under `[text]
    prefix`)."""
    prefix = recipe.text.get("prefix")
    try:
        return model.get_submodule(path)
    except AttributeError:
        if not prefix:
            raise
    return model.get_submodule(prefix + path.removeprefix("model."))
