"""The kernels' variants (issues 64 and 65): the experts' gated activation (silu, GELU-tanh,
GPT-OSS's clamped SwiGLU) and biases, the router's bias, as compile-time variants the registry
owns (`registry.Variant`). CPU: twins of the kernels' arithmetic (cuda/planes.cuh `glu`,
`store_h`, `WITH_DOWN_BIAS`) against the torch reference (runtime/moe/activation.py), and the
programs each variant compiles. The GPU tests of the variants are in tests/test_kernels.py
(`test_variant_kernels_match_reference` and the two after it), beside the helpers they share."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pwctl.build import tiny
from pwctl.format.recipe import CLAMPED_SWIGLU, MoESpec
from pwctl.kernels import build, geometry, registry
from pwctl.runtime.moe import prep
from pwctl.runtime.moe.activation import ExpertBias, expert_mlp, glu_of
from pwctl.runtime.moe.fused import variant_of

ALPHA, LIMIT = 1.702, 7.0


def _spec(act: str, bias: bool = False, **kw) -> MoESpec:
    return MoESpec(
        8, 2, 64, 96, kw.pop("order", "softmax_topk"), True, 1.0, 0, False, act, bias, bias, **kw
    )


# --- CPU twins of the kernels' arithmetic ---------------------------------------------------------


def _glu_twin(variant: registry.Variant, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """cuda/planes.cuh `glu` as written there, in float32 (`__fdividef(v, 1 + __expf(-v))`)."""
    if variant.glu == "silu":
        return gate / (1 + torch.exp(-gate)) * up
    if variant.glu == "gelu_tanh":
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (1 + torch.tanh(inner)) * up
    g = gate.clamp(max=variant.swiglu_limit)
    u = up.clamp(-variant.swiglu_limit, variant.swiglu_limit)
    return (u + 1) * (g / (1 + torch.exp(-variant.swiglu_alpha * g)))


@pytest.mark.parametrize(
    "act", ["silu", "gelu_pytorch_tanh", CLAMPED_SWIGLU], ids=["silu", "gelu_tanh", "swiglu"]
)
def test_glu_twin_matches_the_torch_reference(act):
    """Each variant's activation as the kernels compute it equals activation.py's (the torch
    paths' and transformers'): to a few float32 ulps, and h as the kernels store it (fp16) to one
    fp16 rounding. The gates and ups reach past GPT-OSS's limit on both sides."""
    spec = _spec(act)
    variant = variant_of(spec)
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(4096, generator=gen) * 6
    up = torch.randn(4096, generator=gen) * 6
    want = glu_of(spec)(gate, up)
    got = _glu_twin(variant, gate, up)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # (torch may vectorize: ulps)
    torch.testing.assert_close(got.half(), want.half(), rtol=1e-3, atol=1e-3)
    if act == CLAMPED_SWIGLU:  # the clamps bite: past the limit the gate's output stops growing
        assert float(gate.max()) > LIMIT and float(up.min()) < -LIMIT


def _expert_twin(
    x: torch.Tensor,
    w: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bias: ExpertBias,
    e: int,
    weight: torch.Tensor,
    variant: registry.Variant,
    k_split: int,
) -> torch.Tensor:
    """One expert's weighted output as the kernels form it: gate / up sums plus their biases,
    then glu, h rounded to fp16 (`store_h`); down's columns over `k_split` CTAs, each sum times
    the routing weight, the down bias added by part 0 only (`WITH_DOWN_BIAS`), all added
    together (the atomics)."""
    gate, up, down = w
    g = x @ gate.T + bias.gate[e].float()
    u = x @ up.T + bias.up[e].float()
    h = _glu_twin(variant, g, u).half().float()
    out = torch.zeros(x.shape[0], down.shape[0])
    for part, cols in enumerate(torch.arange(down.shape[1]).chunk(k_split)):
        s = h[:, cols] @ down[:, cols].T
        if part == 0:
            s = s + bias.down[e].float()
        out += weight[:, None] * s
    return out


@pytest.mark.parametrize("k_split", [1, 3])
def test_bias_twin_adds_each_bias_once_inside_the_routing_weight(k_split):
    """GPT-OSS's biases where transformers' GptOssExperts puts them: gate / up biases before
    the clamped SwiGLU, the down bias inside the weighted expert output (w (W_d h + b_d)), once
    a pair however many CTAs split down's columns."""
    spec = _spec(CLAMPED_SWIGLU, bias=True)
    variant = variant_of(spec)
    gen = torch.Generator().manual_seed(1)
    H, inter, T = spec.hidden, spec.intermediate, 5
    w = tuple(torch.randn(*s, generator=gen) * 0.2 for s in ((inter, H), (inter, H), (H, inter)))
    bias = ExpertBias(
        *(torch.randn(spec.num_experts, n, generator=gen).half() for n in (inter, inter, H))
    )
    x = torch.randn(T, H, generator=gen)
    weight = torch.rand(T, generator=gen)
    e = 3
    b = tuple(t.float() for t in bias.of(e))
    want = expert_mlp(x, *w, glu_of(spec), b) * weight[:, None]  # type: ignore[arg-type]
    got = _expert_twin(x, w, bias, e, weight, variant, k_split)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    without = expert_mlp(x, *w, glu_of(spec)) * weight[:, None]  # type: ignore[arg-type]
    assert float((got - without).abs().max()) > 0.1  # the biases count


# --- the variants in the registry and their programs ---------------------------------------------


def test_each_recipes_model_takes_its_variant():
    """The recipes' models map to the registry's variants (GPT-OSS: the clamped SwiGLU with
    biases on the experts and the router; Gemma-4: GELU-tanh; the others: the silu build), and
    an activation no kernel computes is one line of error."""
    from pwctl.format.recipe import load_recipe, resolve_spec

    def spec_of(arch: str, config=None) -> MoESpec:
        return resolve_spec(load_recipe(arch), (config or tiny.tiny_config(arch)).to_dict())

    gpt_oss = spec_of("gpt_oss")  # (the tiny config's limit is its own)
    consts = {"swiglu_alpha": gpt_oss.swiglu_alpha, "swiglu_limit": gpt_oss.swiglu_limit}
    assert variant_of(gpt_oss) == replace(registry.GPT_OSS, **consts)
    assert variant_of(spec_of("gemma4", tiny.gemma4_config())) == registry.GELU_TANH
    assert variant_of(spec_of("qwen2_moe")) == registry.DEFAULT
    with pytest.raises(ValueError, match=r"^activation relu: the kernels implement") as err:
        variant_of(_spec("relu"))
    assert "\n" not in str(err.value)


def test_launch_names_carry_the_variant_a_part_compiles():
    """`qualified` names a kernel of a part that compiles otherwise than the default's with its
    variant, and `unqualified` reads it back; the prep launches are the default build's in
    every variant, route_prep differs only where the router has a bias."""
    for v in registry.VARIANTS:
        for name in registry.BY_NAME:
            q = registry.qualified(name, v)
            assert registry.unqualified(q) == (
                name,
                registry.part_variant(registry.PART_OF[name], v),
            )
        assert registry.qualified("decode_prep", v) == "decode_prep"
    assert registry.qualified("gate_up_n8", registry.DEFAULT) == "gate_up_n8"
    assert registry.qualified("gate_up_n8", registry.GELU_TANH) == "gate_up_n8@gelu_tanh"
    assert registry.qualified("route_prep", registry.GELU_TANH) == "route_prep"
    assert registry.qualified("route_prep", registry.GPT_OSS) == "route_prep@router_bias"
    odd = registry.Variant("clamped_swiglu", True, False, 1.5, 9.0)
    assert registry.unqualified(registry.qualified("down_p1", odd)) == ("down_p1", odd)


def test_the_default_programs_name_the_silu_build_without_biases():
    """Every program names its variant (the sources stop without one); the default's are the
    silu build without biases, and a part reads only what its family reads: the prep part is
    one program in every variant, the route part differs by its router bias alone."""
    for part in range(len(registry.PARTS)):
        text = build.part_source(part)
        family = registry.part_family(part)
        if family in ("lookup", "popc", "prefill", "prefill_wg"):
            assert "#define PWCTL_GLU GLU_SILU\n#define PWCTL_EXPERT_BIAS 0\n" in text
            assert "SWIGLU_ALPHA" not in text and "PWCTL_ROUTER_BIAS" not in text
    prep_part, route_part = registry.PART_OF["decode_prep"], registry.PART_OF["route_prep"]
    assert {build.part_source(prep_part, v) for v in registry.VARIANTS} == {
        build.part_source(prep_part)
    }
    plain, biased = build.part_source(route_part), build.part_source(route_part, registry.GPT_OSS)
    assert plain.replace("PWCTL_ROUTER_BIAS 0", "PWCTL_ROUTER_BIAS 1") == biased
    swiglu = build.part_source(registry.PART_OF["gate_up_n8"], registry.GPT_OSS)
    for line in ("PWCTL_GLU GLU_CLAMPED_SWIGLU", "PWCTL_EXPERT_BIAS 1", "SWIGLU_ALPHA 1.702f"):
        assert f"#define {line}\n" in swiglu
    assert "#define SWIGLU_LIMIT 7.0f\n" in swiglu


def test_route_launch_takes_the_router_bias_as_its_last_hole(monkeypatch):
    """With a router bias route_prep's build takes it last, a hole each call fills
    (`routed_pointers`), under the variant's launch name."""
    monkeypatch.setattr(geometry, "sm_count", lambda: 132)
    spec = _spec(CLAMPED_SWIGLU, bias=True, order="topk_softmax")
    T, H, wpad = 2, spec.hidden, 8
    pairs, xf = prep.decode_buffers(T, spec.top_k, spec.num_experts, wpad, torch.device("cpu"))
    routing = prep.routing_buffers(T, spec, False, torch.device("cpu"))
    done = torch.zeros(1, dtype=torch.int32)
    plain = prep.route_launch(T, H, spec, False, wpad, done, pairs, xf, routing, None)
    biased = prep.route_launch(
        T, H, spec, False, wpad, done, pairs, xf, routing, None, registry.GPT_OSS
    )
    assert (plain.name, biased.name) == ("route_prep", "route_prep@router_bias")
    assert biased.holes == (*plain.holes, plain.count) and biased.count == plain.count + 1
    x, gw, out, rb = torch.zeros(T, H), torch.zeros(8, H), torch.zeros(T, H), torch.zeros(8)
    assert len(prep.routed_pointers(x, gw, None, out, rb)) == len(biased.holes)
    assert len(prep.routed_pointers(x, gw, None, out)) == len(plain.holes)
