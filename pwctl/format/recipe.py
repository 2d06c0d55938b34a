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
    return Recipe(
        model_type=data["model_type"],
        moe_module=data["moe_module"],
        config_keys=data["config"],
        routing=routing,
        per_expert=data["per_expert"],
        fused=data["fused"],
        shared=data.get("shared", {}),
        rename=data.get("rename", {}),
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
        act=str(getattr(cfg, "hidden_act", "silu")),
    )
