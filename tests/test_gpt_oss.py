"""GPT-OSS (issue 65): the recipe's fields against transformers' own modules, MXFP4 checkpoints
read exactly, attention sinks beside sliding windows in the paged attention path, and the
reference path on tiny random checkpoints (bf16 and MXFP4 input: the same weights)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from shared import served
from transformers import AutoModelForCausalLM

from pwctl.build import mxfp4, tiny
from pwctl.build.checkpoint import Checkpoint
from pwctl.build.convert import ConvertOptions, convert, plan_blocks
from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.format.recipe import CLAMPED_SWIGLU, load_recipe, resolve_spec
from pwctl.policy import parse_policy
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.moe.activation import glu_of
from pwctl.runtime.moe.block import MoEBlock
from pwctl.runtime.moe.router import route


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> dict[str, object]:
    """Tiny GPT-OSS checkpoints, bf16 and MXFP4 (the same weights), and their packs."""
    root = tmp_path_factory.mktemp("gpt_oss")
    out: dict[str, object] = {}
    for kind in ("bf16", "mxfp4"):
        src = tiny.make_checkpoint("gpt_oss", root / kind, mxfp4=kind == "mxfp4")
        convert(src, root / f"{kind}-pack", ConvertOptions())
        out[kind], out[f"{kind}-pack"] = src, root / f"{kind}-pack"
    return out


def spec_of(config: dict):
    return resolve_spec(load_recipe("gpt_oss"), config)


# --- the recipe's fields, each against transformers' module -----------------------------------


def test_recipe_resolves_every_gpt_oss_field():
    config = tiny.tiny_config("gpt_oss").to_dict()
    spec = spec_of(config)
    assert spec.order == "topk_softmax" and spec.router_bias and spec.expert_bias
    assert spec.gate_up_interleaved and spec.act == CLAMPED_SWIGLU
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, 0.75)  # the config's limit
    assert (spec.num_experts, spec.top_k, spec.intermediate) == (4, 2, 128)
    del config["swiglu_limit"], config["swiglu_alpha"]  # an older config.json: the release's
    assert (spec_of(config).swiglu_alpha, spec_of(config).swiglu_limit) == (1.702, 7.0)
    recipe = load_recipe("gpt_oss")
    assert recipe.moe_returns == "tuple" and not recipe.per_expert
    assert recipe.in_memory_name("model.layers.3.mlp.router.bias") == "model.layers.3.mlp.gate.bias"
    mixtral = resolve_spec(load_recipe("mixtral"), tiny.tiny_config("mixtral").to_dict())
    assert not (mixtral.router_bias or mixtral.expert_bias or mixtral.gate_up_interleaved)


def test_router_bias_top_k_then_softmax_equals_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = tiny.tiny_config("gpt_oss", experts=8)
    torch.manual_seed(0)
    router = GptOssTopKRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.bias.normal_(0.0, 3.0)  # large enough to change the choice
    x = torch.randn(64, cfg.hidden_size)
    _, scores, index = router(x)
    spec = spec_of(cfg.to_dict())
    weights, got = route(torch.nn.functional.linear(x, router.weight, router.bias), spec)
    assert torch.equal(got, index)
    torch.testing.assert_close(weights, scores, rtol=0, atol=1e-7)
    _, unbiased = route(x @ router.weight.T, spec)
    assert not torch.equal(unbiased, index)  # the bias mattered


def test_clamped_swiglu_equals_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    for limit in (7.0, 0.75):
        cfg = tiny.tiny_config("gpt_oss")
        cfg.swiglu_limit = limit
        experts = GptOssExperts(cfg)
        gate_up = torch.randn(50, 2 * cfg.intermediate_size) * 6  # past the limit both ways
        want = experts._apply_gate(gate_up)
        got = glu_of(spec_of(cfg.to_dict()))(gate_up[:, 0::2], gate_up[:, 1::2])
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert (gate_up.abs() > limit).any()


def test_transposed_interleaved_experts_and_their_biases(gpt_oss):
    """plan_blocks reads gate / up / down of [E, H, 2I] gate_up (interleaved) and [E, I, H] down
    as [out, in] blocks; the biases go to nonexpert.safetensors, 16-bit, under transformers'
    names; the router under MoEBlock's `gate`. One MoE block equals transformers' GptOssMLP."""
    src = gpt_oss["bf16"]
    ckpt = Checkpoint(src)
    recipe = load_recipe("gpt_oss")
    spec = resolve_spec(recipe, ckpt.config)
    _, blocks, consumed, layouts = plan_blocks(ckpt, recipe, spec)
    assert set(layouts.values()) == {"fused"}
    prefix = "model.layers.1.mlp.experts"
    gate_up, down = ckpt.tensor(f"{prefix}.gate_up_proj"), ckpt.tensor(f"{prefix}.down_proj")
    by_name = {b.name: b for b in blocks}
    for e in range(spec.num_experts):
        for proj, want in (
            ("gate", gate_up[e][:, 0::2].T),
            ("up", gate_up[e][:, 1::2].T),
            ("down", down[e].T),
        ):
            got = by_name[f"layers.1.experts.{e}.{proj}"].fetch()
            assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert consumed == {f"model.layers.{n}.mlp.experts.{p}" for n in (0, 1)
                        for p in ("gate_up_proj", "down_proj")}  # fmt: skip
    nonexpert = Pack(gpt_oss["bf16-pack"]).nonexpert()
    assert nonexpert[f"{prefix}.gate_up_proj_bias"].dtype == torch.bfloat16
    assert f"{prefix}.down_proj_bias" in nonexpert and "model.layers.1.mlp.gate.bias" in nonexpert

    engine = Engine(Pack(gpt_oss["bf16-pack"]))
    engine.set_policy(parse_policy("fp16"))
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    mine = next(m for m in engine.model.modules() if isinstance(m, MoEBlock) and m.layer == 1)
    x = torch.randn(1, 40, spec.hidden)
    with torch.no_grad():
        want, _ = source.model.layers[1].mlp(x)
        got, scores = mine(x)
    assert scores is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the clamp is live in this model: some gate / up pre-activations pass the limit
    with torch.no_grad():
        h = source.model.layers[1].mlp.experts
        gu = x[0] @ h.gate_up_proj[0] + h.gate_up_proj_bias[0]
    assert (gu[:, 0::2] > spec.swiglu_limit).any() and (gu[:, 1::2].abs() > spec.swiglu_limit).any()


# --- MXFP4 ------------------------------------------------------------------------------------


def test_mxfp4_dequantizes_exactly_as_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 20, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (3, 20, 4), dtype=torch.uint8, generator=gen)
    scales[0, 0, 0], scales[0, 0, 1] = 127, 1  # 1.0 and 2^-126
    ours = mxfp4.dequantize(blocks, scales)  # [E, out, in]
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        assert torch.equal(ours.to(dtype), theirs.transpose(1, 2))
    assert torch.equal(ours.to(torch.bfloat16).float(), ours)  # exact in bf16
    nan = scales.clone()
    nan[1, 2, 3] = mxfp4.SCALE_NAN
    assert mxfp4.dequantize(blocks, nan)[1, 2, 96:].isnan().all()
    # quantize is dequantize's inverse on the grid
    b2, s2 = mxfp4.quantize(ours)
    assert torch.equal(mxfp4.dequantize(b2, s2), ours)


def test_mxfp4_and_bf16_checkpoints_give_identical_packs(gpt_oss):
    a, b = Pack(gpt_oss["bf16-pack"]), Pack(gpt_oss["mxfp4-pack"])
    assert set(b.manifest.source["layouts"].values()) == {"mxfp4"}
    assert "quantization_config" not in b.manifest.config
    assert "quantization_config" not in json.loads((b.path / "config.json").read_text())
    for x, y in zip(a.blocks, b.blocks, strict=True):
        assert x.name == y.name and x.reference_crc32 == y.reference_crc32
        assert [p.crc32 for p in x.planes] == [p.crc32 for p in y.planes]
    on_disk = load_file(gpt_oss["mxfp4"] / "model.safetensors")
    assert not any(n.endswith("_blocks") or n.endswith("_scales") for n in b.nonexpert())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in on_disk  # really MXFP4 input


@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_reference_path_equals_transformers(kind, gpt_oss):
    """float32 logits of the fp16 policy (the checkpoint's bf16 / MXFP4 experts) equal
    transformers' to 1e-4 (its bf16 checkpoint: MXFP4's weights dequantized), greedy tokens
    are identical, KL at 8 bits < 1e-3 and falls with the width."""
    engine = Engine(Pack(gpt_oss[f"{kind}-pack"]))
    source = AutoModelForCausalLM.from_pretrained(gpt_oss["bf16"], dtype=torch.float32).eval()
    ids = torch.randint(1, tiny.VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = source(ids).logits
    assert ref.std() > 1.0
    engine.set_policy(parse_policy("fp16"))
    torch.testing.assert_close(engine.logits(ids), ref, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        theirs = source.generate(
            ids[:1, :8], attention_mask=torch.ones(1, 8, dtype=torch.long),
            max_new_tokens=16, do_sample=False, pad_token_id=0,
        )[0, 8:]  # fmt: skip
    assert engine.generate_ids(ids[0, :8].tolist(), 16) == theirs.tolist()
    refl = torch.log_softmax(engine.logits(ids), -1)
    kls = []
    for bits in (8, 5, 3):
        engine.set_policy(parse_policy(f"uniform:{bits}"))
        out = torch.log_softmax(engine.logits(ids), -1)
        kls.append(float((refl.exp() * (refl - out)).sum(-1).mean()))
    assert kls[0] < 1e-3 and kls[0] < kls[1] < kls[2], kls


def mxfp4_copy(gpt_oss, tmp_path, edit) -> tuple:
    src = tmp_path / "src"
    shutil.copytree(gpt_oss["mxfp4"], src)
    shard = src / "model.safetensors"
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return src, tmp_path / "out"


def assert_nothing_written(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_mxfp4_missing_scales_is_one_line_and_leaves_nothing(gpt_oss, tmp_path):
    name = "model.layers.1.mlp.experts.down_proj_scales"
    src, out = mxfp4_copy(gpt_oss, tmp_path, lambda t: t.pop(name))
    with pytest.raises(PwctlError, match=f"has no scales tensor {name}") as e:
        convert(src, out, ConvertOptions())
    one_line(e)
    assert_nothing_written(out)


def test_mxfp4_shape_mismatch_is_one_line_and_leaves_nothing(gpt_oss, tmp_path):
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"

    def drop_a_group(t):
        t[name] = t[name][..., :-1].contiguous()

    src, out = mxfp4_copy(gpt_oss, tmp_path, drop_a_group)
    with pytest.raises(PwctlError, match=rf"MXFP4 tensor {name} has shape \[4, 256, 3\]") as e:
        convert(src, out, ConvertOptions())
    one_line(e)
    assert_nothing_written(out)

    def bad_bias(t):
        t["model.layers.0.mlp.experts.down_proj_bias"] = torch.zeros(4, 7, dtype=torch.bfloat16)

    shutil.rmtree(src)
    src, out = mxfp4_copy(gpt_oss, tmp_path, bad_bias)
    with pytest.raises(PwctlError, match=r"down_proj_bias has shape \[4, 7\], expected \[4, 128\]"):
        convert(src, out, ConvertOptions())
    assert_nothing_written(out)


def test_mxfp4_file_truncated_mid_tensor_is_caught_by_the_shard_check(gpt_oss, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(gpt_oss["mxfp4"], src)
    shard = src / "model.safetensors"
    ckpt = Checkpoint(src)
    info = ckpt.info("model.layers.1.mlp.experts.down_proj_blocks")
    shard.write_bytes(shard.read_bytes()[: info.start + info.nbytes // 2])  # mid-tensor
    with pytest.raises(PwctlError, match="model.safetensors: truncated shard") as e:
        convert(src, tmp_path / "out", ConvertOptions())
    one_line(e)
    assert_nothing_written(tmp_path / "out")


# --- attention sinks with sliding windows, in the paged attention path --------------------------


@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_with_sinks_equals_transformers(window):
    """Packed spans (a prefill from 0, a chunk after cached tokens), batched decode rows and the
    fixed-shape DecodeBatch a CUDA graph reads: each equals transformers' GPT-OSS eager
    attention (sinks in the softmax) over the whole sequence, with and without a window."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from pwctl.runtime.engine.attention import DecodeBatch, PagedBatch, SeqSpan, paged_attention
    from pwctl.runtime.engine.decode_graphs import cache_rows
    from pwctl.runtime.memory.kv_cache import KVCache, KVLayout

    gen = torch.Generator().manual_seed(0)
    q_heads, kv_heads, D = 4, 2, 8
    sinks = torch.randn(q_heads, generator=gen) * 2
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=2, sinks=sinks, training=False)
    lengths, new = [7, 5, 1, 9, 3], [7, 2, 1, 1, 1]  # tokens per sequence; this step's
    seqs = [
        [torch.randn(1, h, n, D, generator=gen) for h in (q_heads, kv_heads, kv_heads)]
        for n in lengths
    ]

    def reference(q, k, v):
        n = q.shape[2]
        pos = torch.arange(n)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
        mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
        out, _ = eager_attention_forward(module, q, k, v, mask, 0.3)
        return out[0]  # [n, q_heads, D]

    want = torch.cat([reference(*s)[-m:] for s, m in zip(seqs, new, strict=True)])
    kv = KVCache(KVLayout(n_layers=1, kv_heads=kv_heads, head_dim=D), capacity=17, block_size=4)
    kv.k[0].fill_(float("nan"))  # unwritten rows must never be read
    kv.v[0].fill_(float("nan"))
    spans, slots, blocks, start = [], [], [], 0
    for i, ((_, k, v), n, m) in enumerate(zip(seqs, lengths, new, strict=True)):
        rows = torch.arange(n) + 12 * i + 4  # three 4-token blocks a sequence; block 0 unused
        past = n - m
        kv.write(0, rows[:past], k[0, :, :past].transpose(0, 1), v[0, :, :past].transpose(0, 1))
        spans.append(SeqSpan(start, start + m, past, rows))
        slots.append(rows[past:])
        blocks.append(torch.arange(3) + 3 * i + 1)
        start += m
    q, k, v = (torch.cat([s[j][:, :, -m:] for s, m in zip(seqs, new, strict=True)], 2)
               for j in range(3))  # fmt: skip

    def attend(batch, q, k, v):
        out, _ = paged_attention(
            module, q, k, v, None, 0.3, sliding_window=window, pwctl_batch=batch, s_aux=sinks
        )
        return out[0]

    packed = PagedBatch(kv, torch.cat(slots), spans)
    torch.testing.assert_close(attend(packed, q, k, v), want, rtol=1e-5, atol=1e-6)
    assert packed.decode_group(window) is not None  # the three decode rows went together
    without, _ = paged_attention(module, q, k, v, None, 0.3, sliding_window=window,
                                 pwctl_batch=PagedBatch(kv, torch.cat(slots), spans))  # fmt: skip
    assert not torch.allclose(without[0], want, atol=1e-3)  # the sinks matter
    # decode rows only, in the fixed shapes of a CUDA graph's step
    rows = list(range(2, 5))
    n = torch.tensor([lengths[i] for i in rows])
    table, _ = cache_rows(kv, torch.stack([blocks[i] for i in rows]), n)
    fixed = DecodeBatch(kv, torch.cat([slots[i] for i in rows]), table, n)
    got = attend(fixed, q[:, :, -3:], k[:, :, -3:], v[:, :, -3:])
    torch.testing.assert_close(got, want[-3:], rtol=1e-5, atol=1e-6)


def test_calibrated_conversion_of_either_input(gpt_oss, tmp_path):
    """--calib runs the source model (MXFP4: dequantized by transformers, no kernels) and
    weighs the quantizer by E[x^2] of gate / up's input and of down's: glu(gate x + b, up x + b)
    of the interleaved columns. Both inputs give the same statistics, so the same planes."""
    calib = tmp_path / "calib.txt"
    calib.write_text(tiny.TOKENIZER_TEXT * 20)
    packs = []
    for kind in ("bf16", "mxfp4"):
        convert(gpt_oss[kind], tmp_path / kind, ConvertOptions(calib=calib, calib_tokens=512))
        packs.append(Pack(tmp_path / kind))
    assert all(p.manifest.weighting == "calib-ex2" for p in packs)
    assert all(b.importance_tokens is not None for b in packs[0].blocks)
    for x, y in zip(*(p.blocks for p in packs), strict=True):
        assert [p.crc32 for p in x.planes] == [p.crc32 for p in y.planes]
    engine = Engine(packs[1])
    ids = torch.randint(1, tiny.VOCAB, (1, 32), generator=torch.Generator().manual_seed(2))
    engine.set_policy(parse_policy("fp16"))
    ref = torch.log_softmax(engine.logits(ids), -1)
    engine.set_policy(parse_policy("uniform:8"))
    out = torch.log_softmax(engine.logits(ids), -1)
    assert float((ref.exp() * (ref - out)).sum(-1).mean()) < 1e-3


# --- end to end, as a user runs it -------------------------------------------------------------


def test_end_to_end_convert_profile_generate_serve_bench(gpt_oss, tmp_path):
    """convert (bf16 and MXFP4 input), profile, generate, bench --ppl through the CLI, then
    `pwctl serve` in its own process: completions equal the reference path's greedy tokens."""

    import httpx
    from typer.testing import CliRunner

    from pwctl.cli import app

    runner = CliRunner()
    packs = {}
    for kind in ("bf16", "mxfp4"):
        packs[kind] = tmp_path / f"pack-{kind}"
        args = ["convert", str(gpt_oss[kind]), str(packs[kind]), "--min-bits", "3"]
        r = runner.invoke(app, [*args, "--max-bits", "6", "--json", str(tmp_path / "c.json")])
        assert r.exit_code == 0, r.output
        assert json.loads((tmp_path / "c.json").read_text())["blocks"] == 2 * 4 * 3
    pack = packs["mxfp4"]
    data = tmp_path / "text.txt"
    data.write_text(tiny.TOKENIZER_TEXT * 20)
    r = runner.invoke(app, ["profile", str(pack), "--data", str(data), "--samples", "2",
                            "--seq-len", "32", "--method", "measured"])  # fmt: skip
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["generate", str(pack), "--prompt", "The quick brown",
                            "--max-tokens", "6", "--policy", "pagedweight:0.5",
                            "--json", str(tmp_path / "g.json")])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "g.json").read_text())["policy"] == "pagedweight:0.5"
    r = runner.invoke(app, ["bench", str(pack), "--ppl", "--data", str(data), "--seq-len", "64",
                            "--policy", "fp16", "--policy", "uniform:3", "--policy", "uniform:6",
                            "--json", str(tmp_path / "b.json")])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = {x["policy"]: x for x in json.loads((tmp_path / "b.json").read_text())["results"]}
    # MXFP4 experts: a table's rows hold few distinct values (16 codes x a few exponents), which
    # 6-bit tables of this tiny model hold exactly
    assert rows["fp16"]["kl"] == 0 and rows["uniform:3"]["kl"] > rows["uniform:6"]["kl"] >= 0

    engine = Engine(Pack(pack))
    engine.set_policy(parse_policy("uniform:4"))
    prompt = "It is a truth universally acknowledged"
    want = engine.tokenizer.decode(
        engine.generate_ids(engine.tokenizer(prompt).input_ids, 12), skip_special_tokens=True
    )
    with served(pack, "--policy", "uniform:4", "--max-model-len", "256", seconds=120) as url:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        chat = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


def test_the_cuda_kernels_take_gpt_oss_in_its_variant(gpt_oss):
    """The fused kernels' GPT-OSS build (issue 65 item 5): the clamped SwiGLU with the experts'
    and the router's biases (`registry.GPT_OSS`; tests/test_kernel_variants.py has its twins and
    GPU tests), and route_prep takes its biased router (`can_route` on the CPU: torch's)."""
    from pwctl.runtime.moe.fused import variant_of
    from pwctl.runtime.moe.prep import can_route

    spec = spec_of(tiny.tiny_config("gpt_oss").to_dict())
    v = variant_of(spec)
    assert (v.glu, v.expert_bias, v.router_bias) == ("clamped_swiglu", True, True)
    assert (v.swiglu_alpha, v.swiglu_limit) == (spec.swiglu_alpha, spec.swiglu_limit)
    assert can_route(spec, torch.zeros(1, spec.hidden), torch.zeros(4, spec.hidden))


def test_profile_proxy_keeps_the_biases(gpt_oss):
    """profile's one-pass proxy runs each expert with its biases (and without autograd: the
    biases are parameters): finite damage that falls with the width."""
    from pwctl.build.profile import run_profile

    engine = Engine(Pack(gpt_oss["bf16-pack"]))
    ids = torch.randint(1, tiny.VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    profile = run_profile(engine, ids, "proxy")
    damage = torch.as_tensor(profile.damage)
    assert torch.isfinite(damage).all()
    assert (damage[:, 0] >= damage[:, -1]).all() and damage[:, 0].sum() > damage[:, -2].sum()
