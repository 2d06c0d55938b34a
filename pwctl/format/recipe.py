"""Per-architecture knowledge as data: `pwctl/recipes/<model_type>.toml`.

A recipe names an architecture's expert tensors (per-expert hub layout and transformers' fused
layout), the config keys that hold its routing fields, and how its router combines experts. The
converter and the MoE module read only this, so a new architecture needs a recipe, not code.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pwctl.errors import PwctlError

RECIPE_DIR = Path(__file__).parents[1] / "recipes"
ROUTER_ORDERS = ("softmax_topk", "topk_softmax")
PROJECTIONS = ("gate", "up", "down")
# the experts' gated activation: act(gate) * up with transformers' ACT2FN[hidden_act], or GPT-OSS's
# clamped SwiGLU (runtime/moe/activation.py)
CLAMPED_SWIGLU = "clamped_swiglu"
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}  # GPT-OSS's, where a config lacks them
MOE_RETURNS = ("tensor", "tuple")  # what transformers' decoder layer unpacks from the MoE block


@dataclass(frozen=True)
class Recipe:
    model_type: str
    moe_module: str
    config_keys: dict[str, str]
    routing: dict[str, Any]
    per_expert: dict[str, str]
    fused: dict[str, str]
    shared: dict[str, str] = field(default_factory=dict)
    rename: dict[str, str] = field(default_factory=dict)
    # [experts]: act (CLAMPED_SWIGLU overrides hidden_act), bias (gate_up / down biases, 16-bit
    # non-expert tensors), transposed (fused tensors [E, in, out]), interleaved (gate_up's
    # gate and up alternate)
    experts: dict[str, Any] = field(default_factory=dict)
    mxfp4: dict[str, str] = field(default_factory=dict)  # blocks / scales names of a fused name
    moe_returns: str = "tensor"

    def moe_path(self, layer: int) -> str:
        return self.moe_module.format(layer=layer)

    def in_memory_name(self, disk_name: str) -> str:
        """Non-expert tensor name as transformers holds it (e.g. Mixtral's block_sparse_moe)."""
        for old, new in self.rename.items():
            disk_name = disk_name.replace(old, new)
        return disk_name


@dataclass(frozen=True)
class MoESpec:
    """A recipe resolved against one model's config: everything the MoE module needs."""

    num_experts: int
    top_k: int
    intermediate: int
    hidden: int
    order: str
    norm_topk_prob: bool
    routed_scaling: float
    shared_intermediate: int
    shared_gate: bool
    act: str
    router_bias: bool = False  # the router linear has a bias (GPT-OSS)
    expert_bias: bool = False  # routed experts' gate/up and down have biases
    gate_up_interleaved: bool = False  # gate_up's bias alternates gate, up (as its columns did)
    # CLAMPED_SWIGLU: (up + 1) * gate * sigmoid(alpha gate), gate <= limit, |up| <= limit
    swiglu_alpha: float = SWIGLU["swiglu_alpha"]
    swiglu_limit: float = SWIGLU["swiglu_limit"]

    @property
    def has_shared(self) -> bool:
        return self.shared_intermediate > 0


def supported() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.toml"))


def load_recipe(model_type: str) -> Recipe:
    path = RECIPE_DIR / f"{model_type}.toml"
    if not path.is_file():
        raise PwctlError(
            f"unsupported architecture '{model_type}'; supported: {', '.join(supported())}"
        )
    data = tomllib.loads(path.read_text())
    routing = data.get("routing", {})
    if routing.get("order") not in ROUTER_ORDERS:
        raise PwctlError(f"recipe {path}: routing.order must be one of {ROUTER_ORDERS}")
    if data.get("moe_returns", "tensor") not in MOE_RETURNS:
        raise PwctlError(f"recipe {path}: moe_returns must be one of {MOE_RETURNS}")
    if not data.get("per_expert") and not data.get("fused"):
        raise PwctlError(f"recipe {path}: names no expert tensors ([per_expert] or [fused])")
    return Recipe(
        model_type=data["model_type"],
        moe_module=data["moe_module"],
        config_keys=data["config"],
        routing=routing,
        per_expert=data.get("per_expert", {}),
        fused=data.get("fused", {}),
        shared=data.get("shared", {}),
        rename=data.get("rename", {}),
        experts=data.get("experts", {}),
        mxfp4=data.get("mxfp4", {}),
        moe_returns=data.get("moe_returns", "tensor"),
    )


def resolve_spec(recipe: Recipe, config: dict[str, Any]) -> MoESpec:
    """Read the routing fields through transformers' config class (it fills defaults that
    config.json omits and knows attribute aliases), with the recipe's literals as overrides."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.for_model(**config)
    except (ValueError, TypeError) as e:
        raise PwctlError(f"config.json of a {recipe.model_type} model is unusable ({e})") from None

    def value(name: str, default: Any = None) -> Any:
        if name in recipe.routing:
            return recipe.routing[name]
        key = recipe.config_keys.get(name)
        found = None if key is None else getattr(cfg, key, None)
        if found is None:
            if default is None:
                raise PwctlError(f"config.json of a {recipe.model_type} model lacks '{key}'")
            return default
        return found

    shared_inter = int(value("shared_intermediate", 0)) if recipe.shared else 0
    act = str(recipe.experts.get("act") or getattr(cfg, "hidden_act", "silu"))
    swiglu = {}
    if act == CLAMPED_SWIGLU:  # the config's values where it has them, else GPT-OSS's
        swiglu = {k: float(value(k, default)) for k, default in SWIGLU.items()}
    return MoESpec(
        num_experts=int(value("num_experts")),
        top_k=int(value("top_k")),
        intermediate=int(value("intermediate")),
        hidden=int(cfg.hidden_size),
        order=recipe.routing["order"],
        norm_topk_prob=bool(value("norm_topk_prob", False)),
        routed_scaling=float(value("routed_scaling", 1.0)),
        shared_intermediate=shared_inter,
        shared_gate=bool(recipe.shared.get("gate_weight")),
        act=act,
        router_bias=bool(recipe.routing.get("router_bias", False)),
        expert_bias=bool(recipe.experts.get("bias", False)),
        gate_up_interleaved=bool(recipe.experts.get("interleaved", False)),
        **swiglu,
    )
