"""Gemma-4 MoE (text only): the recipe's fields, convert (its own and the multimodal release's
checkpoints), and the reference path against transformers' Gemma4ForCausalLM on tiny random
configs in float32: logits, greedy tokens, KL by width, the paged experts equal to the store."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from shared import assert_matches_transformers, served

from pwctl.build import tiny
from pwctl.build.convert import ConvertOptions, convert
from pwctl.errors import PwctlError
from pwctl.format import recipe as recipes
from pwctl.format.pack import Pack
from pwctl.format.recipe import load_recipe, resolve_spec
from pwctl.policy import parse_policy
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.moe.block import MoETap
from pwctl.runtime.moe.router import ResidualRouter, route

pytestmark = pytest.mark.skipif(
    not tiny.has_gemma4(),
    reason=f"transformers {transformers.__version__} has no gemma4 (Gemma-4 needs 5.25 or later)",
)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> dict[str, object]:
    """A tiny Gemma-4 checkpoint, its pack, and the same model saved as the multimodal release.
    Logits scaled by 10, not 20: Gemma-4 adds each branch RMS-normalised, so 8-bit weights'
    ~1% error reaches the residual stream undamped and a random model's KL is 4x as large."""
    root = tmp_path_factory.mktemp("gemma4")
    src = tiny.make_checkpoint(tiny.GEMMA4, root / "ckpt", fused=True, logit_scale=10.0)
    multi = tiny.make_checkpoint(tiny.GEMMA4, root / "multi", multimodal=True, logit_scale=10.0)
    convert(src, root / "pack", ConvertOptions())
    return {"src": src, "multi": multi, "pack": root / "pack", "root": root}


# --- the recipe ---------------------------------------------------------------------------------


def test_recipe_resolves_gemma4_fields():
    r = load_recipe("gemma4")
    assert load_recipe("gemma4_text") == r  # `aliases`: Gemma4ForCausalLM's checkpoints
    assert r.moe_path(3) == "model.layers.3.experts" and r.router_path(3) == "model.layers.3.router"
    assert load_recipe("mixtral").router_path(0) is None
    spec = resolve_spec(r, tiny.gemma4_config().to_dict())
    assert (spec.num_experts, spec.top_k, spec.intermediate, spec.hidden) == (4, 2, 64, 128)
    assert spec.act == "gelu_pytorch_tanh"  # `[config] act`: hidden_activation
    assert spec.router_norm == "rms_scaled" and spec.expert_scale and spec.own_router
    assert spec.norm_topk_prob and spec.order == "softmax_topk" and not spec.has_shared
    assert spec.norm_eps == 1e-6
    old = resolve_spec(load_recipe("qwen2_moe"), tiny.tiny_config("qwen2_moe").to_dict())
    assert (old.router_norm, old.expert_scale, old.own_router) == ("none", False, False)
    assert old.act == "silu"


def test_recipe_reads_the_multimodal_config_and_names():
    r = load_recipe("gemma4")
    config = tiny.gemma4_config(multimodal=True).to_dict()
    text = r.text_config(config)  # `[text] config`
    assert text["model_type"] == "gemma4_text" and r.text_config(text) is text
    assert resolve_spec(r, config) == resolve_spec(r, text)
    name = "layers.0.router.scale"
    assert r.text_name(f"model.language_model.{name}") == f"model.{name}"
    assert r.text_name("model.vision_tower.encoder.layers.0.mlp.w") is None  # `[text] drop`
    assert r.text_name("model.embed_audio.embedding_projection.weight") is None
    assert r.text_name("lm_head.weight") == "lm_head.weight"


def test_gemma4_without_moe_is_one_line_error():
    r = load_recipe("gemma4")
    for config in (tiny.gemma4_config(enable_moe_block=False).to_dict(),
                   {k: v for k, v in tiny.gemma4_config().to_dict().items()
                    if k != "enable_moe_block"}):  # fmt: skip
        with pytest.raises(PwctlError, match="enable_moe_block") as e:
            resolve_spec(r, config)
        assert "\n" not in str(e.value)


def test_recipe_rejects_unknown_router_norm(tmp_path, monkeypatch):
    text = (recipes.RECIPE_DIR / "gemma4.toml").read_text()
    (tmp_path / "bad.toml").write_text(text.replace('norm = "rms_scaled"', 'norm = "layer"'))
    (tmp_path / "orphan.toml").write_text(text.replace("router_module =", "# router_module ="))
    monkeypatch.setattr(recipes, "RECIPE_DIR", tmp_path)
    with pytest.raises(PwctlError, match="routing.norm must be one of"):
        load_recipe("bad")
    with pytest.raises(PwctlError, match="need router_module"):
        load_recipe("orphan")


def test_router_is_transformers_router():
    """`[routing] norm = "rms_scaled"` and `per_expert_scale`: the router module's choice is
    transformers' Gemma4TextRouter's, learned scales moved off one."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRouter

    config = tiny.gemma4_config(num_experts=8, top_k_experts=3)
    spec = resolve_spec(load_recipe("gemma4"), config.to_dict())
    torch.manual_seed(0)
    theirs = Gemma4TextRouter(config)
    with torch.no_grad():
        theirs.proj.weight.normal_()
        theirs.scale.uniform_(0.5, 1.5)
        theirs.per_expert_scale.uniform_(0.5, 1.5)
    ours = ResidualRouter(spec)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(40, spec.hidden) * 3
    _, want_w, want_i = theirs(x)
    logits, got_w, got_i = ours(x)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)
    # route's `expert_scale` is the only difference from a plain renormalised softmax-top-k
    plain, index = route(logits, spec)
    torch.testing.assert_close(plain * ours.per_expert_scale[index], got_w)


# --- convert and the reference path ------------------------------------------------------------


def test_logits_tokens_and_kl_match_transformers(gemma4):

    assert_matches_transformers(Engine(Pack(gemma4["pack"])), gemma4["src"])


def test_multimodal_checkpoint_converts_to_its_language_model(gemma4):
    """The ForConditionalGeneration release's names and nested config: the pack holds the
    language model alone (text config, `model.` names) and runs as transformers' text model."""
    from transformers import AutoModelForCausalLM

    out = gemma4["root"] / "multi-pack"
    convert(gemma4["multi"], out, ConvertOptions(max_bits=4))
    pack = Pack(out)
    assert pack.manifest.model_type == "gemma4_text"
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma4_text"
    assert all(not n.startswith("model.language_model.") for n in pack.nonexpert())
    source = AutoModelForCausalLM.from_pretrained(gemma4["multi"], dtype=torch.float32).eval()
    ids = torch.randint(1, tiny.VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    engine = Engine(pack)
    engine.set_policy(parse_policy("fp16"))
    with torch.no_grad():
        ref = source(input_ids=ids).logits
    torch.testing.assert_close(engine.logits(ids), ref, rtol=1e-4, atol=1e-4)


def test_paged_experts_equal_the_store(gemma4):
    pack = Pack(gemma4["pack"])
    store, paged = Engine(pack, experts="store"), Engine(pack, experts="paged")
    ids = torch.randint(1, tiny.VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    for policy in ("uniform:8", "uniform:3"):
        store.set_policy(parse_policy(policy))
        paged.set_policy(parse_policy(policy))
        with MoETap(store.model) as want, MoETap(paged.model) as got:
            torch.testing.assert_close(paged.logits(ids), store.logits(ids), rtol=1e-4, atol=1e-4)
        assert sorted(want.seen) == sorted(got.seen) == pack.manifest.moe_layers
        for layer, (_, index, weights) in want.seen.items():
            assert torch.equal(got.seen[layer][1], index)
            torch.testing.assert_close(got.seen[layer][2], weights)
        prompt = ids[0, :10].tolist()
        assert paged.generate_ids(prompt, 10) == store.generate_ids(prompt, 10)


# --- attention and KV per layer -----------------------------------------------------------------

VARIANTS = {
    # 26B-A4B's attention shape: sliding / full alternating, full layers wider and k_eq_v
    "plain": {},
    # the smaller Gemma-4s' extras: the last layers reuse earlier layers' keys and values, and
    # per-layer inputs
    "shared-kv": dict(
        layers=4, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=tiny.VOCAB,
    ),
}  # fmt: skip


def test_kv_layout_per_layer():
    from pwctl.runtime.memory.kv_cache import KVLayout

    plain = KVLayout.from_config(tiny.gemma4_config())
    assert plain.shapes == ((2, 32), (1, 64)) and plain.n_layers == 2
    assert (plain.kv_heads, plain.head_dim) == (2, 32)  # the widest row (64 floats each)
    assert plain.bytes_per_token() == 2 * 4 * (2 * 32 + 64)
    shared = KVLayout.from_config(tiny.gemma4_config(**VARIANTS["shared-kv"] | {"layers": 4}))
    assert shared.n_layers == 2 and shared.sources == (0, 1, 0, 1)
    assert [shared.owns(a) for a in range(4)] == [True, True, False, False]
    assert shared.bytes_per_token() == plain.bytes_per_token()  # two layers store nothing
    mixtral = KVLayout.from_config(tiny.tiny_config("mixtral"))
    assert mixtral.shapes == () and mixtral.sources == ()  # uniform layouts stay as they were


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batched_engine_equals_transformers(variant, tmp_path):
    """The batching path (pwctl_paged attention over the paged KV cache: chunked prefill past
    the sliding window, decode rows batched) gives transformers' own greedy tokens with the
    source weights (fp16 policy), and at 8 bits the paged experts (their arena holding the KV
    blocks) give the store's, both what the reference path gives; a block counts each layer's
    real bytes."""
    from transformers import AutoModelForCausalLM

    from pwctl.runtime.engine.batcher import BatchConfig
    from pwctl.runtime.engine.scheduler import SamplingParams

    sizes = VARIANTS[variant]
    src = tiny.make_checkpoint(tiny.GEMMA4, tmp_path / "ckpt", logit_scale=10.0, **sizes)
    convert(src, tmp_path / "pack", ConvertOptions())
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    prompts = [list(range(1, 30)), list(range(40, 45)), list(range(100, 121))]
    cfg = BatchConfig(max_batch_tokens=16, max_model_len=96)
    with torch.no_grad():
        outs = [
            source.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            for p in prompts
        ]
    theirs = [o[0, len(p) :].tolist() for o, p in zip(outs, prompts, strict=True)]
    pack = Pack(tmp_path / "pack")
    store = Engine(pack, experts="store")
    store.start_batching(parse_policy("fp16"), None, cfg)
    assert [s.output_ids for s in store.generate_batch(prompts, SamplingParams(12))] == theirs
    for engine in (store, Engine(pack, experts="paged")):
        engine.set_policy(parse_policy("uniform:8"))
        want = [engine.generate_ids(p, 12) for p in prompts]
        engine.start_batching(parse_policy("uniform:8"), None, cfg)
        got = [s.output_ids for s in engine.generate_batch(prompts, SamplingParams(12))]
        assert got == want, engine.experts
        layout = engine.batcher.runner.kv.layout
        assert layout.shapes  # per layer
        assert engine._block_bytes(cfg) >= cfg.block_size * layout.bytes_per_token()
    assert store._block_bytes(cfg) == cfg.block_size * layout.bytes_per_token()


# --- the dense MLP as blocks --------------------------------------------------------------------


def test_dense_mlp_is_blocks_with_a_floor(gemma4):
    """`[dense]`: the dense MLP every token runs is three blocks a layer in the shared
    expert's slot (shared: the planner's floor), not non-expert weights; a budgeted policy
    under pressure keeps them at the floor a shared expert gets, and the proxy profile reads
    the dense MLP's own input."""
    from pwctl.build.profile import run_profile
    from pwctl.runtime.widths.allocator import WidthAllocator
    from pwctl.runtime.widths.planner import PlannerConfig

    pack = Pack(gemma4["pack"])
    m = pack.manifest
    assert m.spec["dense_intermediate"] == 128 and m.spec["shared_intermediate"] == 0
    dense = [b for b in pack.blocks if b.shared]
    assert len(dense) == 3 * len(m.moe_layers)
    assert all(b.expert == m.spec["num_experts"] for b in dense)
    assert {(b.proj, b.rows, b.cols) for b in dense} == {
        ("gate", 128, 128), ("up", 128, 128), ("down", 128, 128)
    }  # fmt: skip
    assert not [n for n in pack.nonexpert() if ".mlp." in n]
    assert resolve_spec(load_recipe("gemma4"), tiny.gemma4_config().to_dict()).has_dense

    engine = Engine(pack)
    ids = torch.randint(1, tiny.VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))
    with MoETap(engine.model) as tap:
        engine.logits(ids)
    for layer in m.moe_layers:  # the dense MLP's input is not the experts'
        assert not torch.allclose(tap.dense_seen[layer], tap.seen[layer][0])
    run_profile(engine, ids, "proxy").save(pack)
    alloc = WidthAllocator(Pack(gemma4["pack"]), parse_policy("pagedweight:0.2"))
    widths = alloc.widths()
    shared = [b.shared for b in pack.blocks]
    floor = m.min_bits + PlannerConfig().shared_floor
    assert all(w >= floor for w, s in zip(widths, shared, strict=True) if s)
    assert min(w for w, s in zip(widths, shared, strict=True) if not s) < floor


def test_calibrated_conversion(gemma4):
    """--calib on the multimodal release: the experts' and the dense MLP's inputs weigh the
    quantizer (the language model's modules found under its prefix)."""
    calib = gemma4["root"] / "calib.txt"
    calib.write_text(tiny.TOKENIZER_TEXT * 40)
    out = gemma4["root"] / "calib-pack"
    convert(gemma4["multi"], out, ConvertOptions(calib=calib, calib_tokens=512, max_bits=4))
    pack = Pack(out)
    assert pack.manifest.weighting == "calib-ex2"
    dense = [b.importance_tokens for b in pack.blocks if b.shared]
    assert dense and all(t == pack.manifest.calib["tokens"] for t in dense)
    assert all(b.importance_tokens is not None for b in pack.blocks)


# --- end to end ---------------------------------------------------------------------------------


def test_commands_end_to_end(gemma4, tmp_path):
    """convert (the multimodal release), profile, fit-residual, generate, bench --ppl and
    serve, through the CLI as a user runs them, on the CPU."""

    import httpx
    from typer.testing import CliRunner

    from pwctl.cli import app

    runner = CliRunner()
    pack = tmp_path / "pack"

    def ok(*args: str) -> dict:
        out = tmp_path / f"{args[0]}.json"
        r = runner.invoke(app, [*args, "--json", str(out)])
        assert r.exit_code == 0, r.output
        return json.loads(out.read_text())

    report = ok("convert", str(gemma4["multi"]), str(pack), "--min-bits", "3", "--max-bits", "6")
    assert report["blocks"] == 2 * (4 + 1) * 3  # 4 experts and the dense MLP, two layers
    data = tmp_path / "calib.txt"
    data.write_text(tiny.TOKENIZER_TEXT * 20)
    ok("profile", str(pack), "--data", str(data), "--samples", "10", "--seq-len", "32")
    assert "r2_test" in ok("fit-residual", str(pack))
    said = ok("generate", str(pack), "--prompt", "The earth", "--max-tokens", "5",
              "--policy", "uniform:4")  # fmt: skip
    assert said["policy"] == "uniform:4"
    bench = ok("bench", str(pack), "--ppl", "--data", str(data), "--seq-len", "64",
               "--policy", "fp16", "--policy", "uniform:3", "--policy", "uniform:6")  # fmt: skip
    kl = {x["policy"]: x["kl"] for x in bench["results"]}
    assert kl["fp16"] == 0 and kl["uniform:3"] > kl["uniform:6"] > 0
    err = {x["policy"]: x["moe_err"] for x in bench["results"]}  # the dense MLP's blocks too
    assert err["fp16"] == 0 and err["uniform:3"] > err["uniform:6"] > 0

    with served(pack, "--max-model-len", "128", "--policy", "uniform:4") as url:
        body = {"model": "x", "prompt": "The earth", "max_tokens": 5, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        engine = Engine(Pack(pack))
        engine.set_policy(parse_policy("uniform:4"))
        want = engine.generate(body["prompt"], 5)
        assert r.json()["choices"][0]["text"] == want


def test_sixteen_bit_experts_refuse_a_dense_mlp(gemma4):
    """The fp16 policy's grouped-GEMM experts (CUDA's) have no dense MLP: one line, at load."""
    with pytest.raises(PwctlError, match="no dense MLP") as e:
        Engine(Pack(gemma4["pack"]), experts="dense")
    assert "\n" not in str(e.value)
