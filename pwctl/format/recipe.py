"""Per-architecture knowledge as data: `pwctl/recipes/<model_type>.toml`.

A recipe names an architecture's expert tensors (per-expert hub layout and transformers' fused
layout), the config keys that hold its routing fields, and how its router combines experts. The
converter and the MoE module read only this, so a new architecture needs a recipe, not code.

Optional parts, for architectures whose MoE is not one module (Gemma-4): `router_module`, a
router of its own that reads the residual stream (`[routing] norm`, `per_expert_scale`), beside
the experts at `moe_module`; `[text]`, the language model of a multimodal checkpoint (its config
key, its tensors' prefix, the towers left out); `aliases`, other model types the recipe serves;
`[config] enabled`, the config flag without which the model has no MoE; `[dense]`, a dense MLP
every token runs beside the experts (its module and tensors): its blocks take the shared
expert's slot (expert = num_experts, `shared`), so its bytes count with the planes.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pwctl.errors import PwctlError

RECIPE_DIR = Path(__file__).parents[1] / "recipes"
ROUTER_ORDERS = ("softmax_topk", "topk_softmax")
ROUTER_NORMS = ("none", "rms_scaled")
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
    router_module: str | None = None  # a router module of its own (reads the residual stream)
    dense: dict[str, str] = field(default_factory=dict)  # module, gate, up, down
    text: dict[str, Any] = field(default_factory=dict)  # a multimodal checkpoint's language model
    aliases: tuple[str, ...] = ()

    def moe_path(self, layer: int) -> str:
        return self.moe_module.format(layer=layer)

    def dense_path(self, layer: int) -> str | None:
        return self.dense["module"].format(layer=layer) if self.dense else None

    def router_path(self, layer: int) -> str | None:
        return None if self.router_module is None else self.router_module.format(layer=layer)

    def text_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The language model's config: `config` itself, or its `[text] config` entry (a
        multimodal checkpoint's)."""
        key = self.text.get("config")
        inner = config.get(key) if key else None
        return dict(inner) if isinstance(inner, dict) else config

    def text_name(self, disk_name: str) -> str | None:
        """A checkpoint tensor's name in the language model alone (the multimodal prefix
        taken off), or None for the towers `[text] drop` leaves out."""
        if any(disk_name.startswith(p) for p in self.text.get("drop", ())):
            return None
        prefix = self.text.get("prefix")
        if prefix and disk_name.startswith(prefix):
            return "model." + disk_name[len(prefix) :]
        return disk_name

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
    # Gemma-4's router (a module of its own, reading the residual stream): "rms_scaled" is a
    # scale-free RMSNorm (eps `norm_eps`) times a learned scale and hidden^-0.5 before the
    # projection; `expert_scale`: the renormalised top-k weights times a learned per-expert scale
    router_norm: str = "none"
    expert_scale: bool = False
    norm_eps: float = 1e-6
    own_router: bool = False  # the router is a module of its own; MoEBlock gets its choice
    # a dense MLP beside the experts (Gemma-4), as blocks in the shared expert's slot: the
    # config's width (a layer's blocks have their own: Gemma-4's double-wide MLP layers differ)
    dense_intermediate: int = 0

    @property
    def has_shared(self) -> bool:
        return self.shared_intermediate > 0

    @property
    def has_dense(self) -> bool:
        return self.dense_intermediate > 0


def supported() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.toml"))


def _recipe_path(model_type: str) -> Path | None:
    """`<model_type>.toml`, or the recipe that lists `model_type` among its aliases."""
    path = RECIPE_DIR / f"{model_type}.toml"
    if path.is_file():
        return path
    for other in sorted(RECIPE_DIR.glob("*.toml")):
        if model_type in tomllib.loads(other.read_text()).get("aliases", ()):
            return other
    return None


def load_recipe(model_type: str) -> Recipe:
    path = _recipe_path(model_type)
    if path is None:
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
    if routing.get("norm", "none") not in ROUTER_NORMS:
        raise PwctlError(f"recipe {path}: routing.norm must be one of {ROUTER_NORMS}")
    if data.get("dense") and data.get("shared"):
        raise PwctlError(f"recipe {path}: [dense] takes the shared expert's slot: not both")
    if (routing.get("norm", "none") != "none" or routing.get("per_expert_scale")) and not data.get(
        "router_module"
    ):
        raise PwctlError(f"recipe {path}: routing.norm and per_expert_scale need router_module")
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
        router_module=data.get("router_module"),
        dense=data.get("dense", {}),
        text=data.get("text", {}),
        aliases=tuple(data.get("aliases", ())),
    )


def resolve_spec(recipe: Recipe, config: dict[str, Any]) -> MoESpec:
    """Read the routing fields through transformers' config class (it fills defaults that
    config.json omits and knows attribute aliases), with the recipe's literals as overrides."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.for_model(**config).get_text_config()
    except (ValueError, TypeError) as e:
        raise PwctlError(f"config.json of a {recipe.model_type} model is unusable ({e})") from None
    flag = recipe.config_keys.get("enabled")
    if flag is not None and not getattr(cfg, flag, False):
        raise PwctlError(
            f"config.json of a {recipe.model_type} model has no MoE ('{flag}' is not true): "
            "pwctl serves MoE models only"
        )

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
    act_key = recipe.config_keys.get("act", "hidden_act")  # Gemma-4: hidden_activation
    act = str(recipe.experts.get("act") or getattr(cfg, act_key, None) or "silu")
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
        router_norm=str(recipe.routing.get("norm", "none")),
        expert_scale=bool(recipe.routing.get("per_expert_scale", False)),
        norm_eps=float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
        own_router=recipe.router_module is not None,
        dense_intermediate=int(value("dense_intermediate", 0)) if recipe.dense else 0,
    )
