"""profile and fit-residual end to end on a tiny pack."""

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pwctl.build import tiny
from pwctl.cli import app
from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.format.profile import Profile, lower_hull
from pwctl.format.residual import ResidualModel

runner = CliRunner()


@pytest.fixture(scope="module")
def profiled(packs, tmp_path_factory):
    root = tmp_path_factory.mktemp("profiled")
    pack = shutil.copytree(packs[("qwen2_moe", "fused")], root / "pack")
    data = root / "calib.jsonl"
    lines = [json.dumps({"text": tiny.TOKENIZER_TEXT[i:] + tiny.TOKENIZER_TEXT}) for i in range(30)]
    data.write_text("\n".join(lines))
    r = runner.invoke(
        app,
        [
            "profile",
            str(pack),
            "--data",
            str(data),
            "--samples",
            "10",
            "--seq-len",
            "32",
            "--json",
            str(root / "p.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    return pack, data, json.loads((root / "p.json").read_text())


def test_profile_damages_are_positive_and_fall_with_width(profiled):
    pack_dir, _, report = profiled
    prof = Profile.load(Pack(pack_dir))
    assert prof.widths == list(range(2, 9))
    assert prof.damage.shape == (len(Pack(pack_dir).blocks), 7)
    assert np.all(prof.damage[:, -1] == 0)
    mean = prof.damage.mean(0)
    assert mean[0] > 0 and np.all(np.diff(mean) < 0), mean
    # per block, a rise with width stays within measurement noise
    rise = np.diff(prof.damage, axis=1).max(1)
    assert np.all(rise <= 0.05 * prof.damage[:, 0] + 1e-6)
    hull = prof.hull
    assert np.all(np.diff(hull, axis=1) <= 1e-12) and np.all(hull >= 0)
    assert report["tokens"] == 320 and report["data"] == ["calib.jsonl"]
    assert report["spearman_proxy_vs_measured"]["overall"] > 0.5
    assert np.allclose(prof.router_share.sum(1), 1.0)
    assert prof.features.shape == (2, 10, 3) and np.all(prof.features > 0)


def test_hull_is_convex_and_lower():
    nbytes = np.array([[1.0, 2, 3, 4, 5]])
    damage = np.array([[10.0, 4, 3.5, 0.5, 0]])
    hull, on = lower_hull(nbytes, damage)
    assert on.tolist() == [[True, True, False, True, True]]
    assert np.all(hull <= damage + 1e-12)
    slopes = np.diff(hull[0]) / np.diff(nbytes[0])
    assert np.all(np.diff(slopes) >= -1e-12)


def test_proxy_method(profiled, tmp_path):
    pack_dir, data, _ = profiled
    copy = shutil.copytree(pack_dir, tmp_path / "pack")
    r = runner.invoke(
        app,
        [
            "profile",
            str(copy),
            "--data",
            str(data),
            "--samples",
            "6",
            "--seq-len",
            "32",
            "--method",
            "proxy",
        ],
    )
    assert r.exit_code == 0, r.output
    prof = Profile.load(Pack(copy))
    assert prof.meta["method"] == "proxy" and prof.damage[:, 0].max() > 0


def test_fit_residual_round_trip(profiled, tmp_path):
    pack_dir, _, _ = profiled
    r = runner.invoke(app, ["fit-residual", str(pack_dir), "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    metrics = json.loads((tmp_path / "r.json").read_text())
    assert {"r2_test", "spearman_test", "spearman_test_average_only"} <= set(metrics)
    model = ResidualModel.load(Pack(pack_dir))
    layer = model.layers[0]
    prof = Profile.load(Pack(pack_dir))
    f = model.factor(layer, prof.features[0])
    assert f.shape == (10,) and np.all(np.isfinite(f)) and np.all(f > 0)
    step = prof.features[:, 0]  # one sequence's features at every layer
    each = [model.factor(li, step[i]) for i, li in enumerate(model.layers)]
    np.testing.assert_allclose(model.layer_factors(model.layers, step), each, rtol=1e-12)


def test_errors(packs, profiled, tmp_path):
    pack_dir, data, _ = profiled
    bare = packs[("mixtral", "fused")]
    r = runner.invoke(app, ["fit-residual", str(bare)])
    assert r.exit_code == 2 and "pack has no profile" in r.output
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    r = runner.invoke(app, ["profile", str(bare), "--data", str(empty)])
    assert r.exit_code == 2 and "no text in the data" in r.output
    r = runner.invoke(app, ["profile", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no such pack" in r.output
    copy = shutil.copytree(pack_dir, tmp_path / "corrupt")
    raw = bytearray((copy / "profile.safetensors").read_bytes())
    raw[-3] ^= 0xFF
    (copy / "profile.safetensors").write_bytes(bytes(raw))
    with pytest.raises(PwctlError, match="corrupt profile"):
        Profile.load(Pack(copy))


def test_budgeted_policies_respect_budget_and_floors(profiled, packs):
    from pwctl.policy import parse_policy
    from pwctl.runtime.engine.engine import Engine
    from pwctl.runtime.moe.block import MoETap

    pack_dir, _, _ = profiled
    engine = Engine(Pack(pack_dir))
    fp16 = sum(b.fp16_bytes for b in engine.pack.blocks)
    shared = np.array([b.shared for b in engine.pack.blocks])
    ids = torch.randint(1, tiny.VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    seen_widths = {}
    for name in ("static:0.25", "pagedweight:0.25", "pagedweight-router:0.25"):
        policy = parse_policy(name)
        history = []
        for _ in range(4):
            engine.set_policy(policy)
            assert engine.store.expert_bytes() <= 0.25 * fp16
            widths = engine.store.widths.copy()
            assert widths.min() >= 2 and widths[shared].min() >= 4  # shared-expert floor
            history.append(widths)
            with MoETap(engine.model) as tap:
                engine.logits(ids)
            engine.observe(tap)
        if name.startswith("static"):
            assert all((h == history[0]).all() for h in history)
        seen_widths[name] = history[-1]
    assert (seen_widths["static:0.25"] != 8).any()  # the budget forced demotions

    with pytest.raises(PwctlError, match="below"):
        engine.set_policy(parse_policy("pagedweight:0.01"))
    engine.set_policy(parse_policy("dynamic-layer:0.25"))
    layer_of = np.array([b.layer for b in engine.pack.blocks])
    widths = engine.store.widths
    assert engine.store.expert_bytes() <= 0.25 * fp16
    assert all(len(set(widths[layer_of == li])) == 1 for li in set(layer_of))  # one per layer
    bare = Engine(Pack(packs[("mixtral", "fused")]))
    with pytest.raises(PwctlError, match="pack has no profile"):
        bare.set_policy(parse_policy("static:0.3"))


def test_pressure_trace_gives_dynamic_policies_the_free_memory(profiled):
    from pwctl.bench.ppl import bootstrap_ci, pressure_trace, run_ppl
    from pwctl.policy import parse_policy
    from pwctl.runtime.engine.engine import Engine

    trace = pressure_trace(9)
    assert trace[0] == 0 and trace[4] == 1 and abs(trace[-1]) < 1e-12
    values = np.array([1.0, 2.0, 3.0, 4.0])
    lo, hi = bootstrap_ci(values, np.ones(4))
    assert lo <= values.mean() <= hi and lo >= 1 and hi <= 4

    pack_dir, _, _ = profiled
    engine = Engine(Pack(pack_dir))
    fp16 = sum(b.fp16_bytes for b in engine.pack.blocks)
    ids = torch.randint(1, tiny.VOCAB, (6, 24), generator=torch.Generator().manual_seed(3))
    names = ["fp16", "static:0.25", "pagedweight:0.25"]
    res = {r.policy: r for r in run_ppl(engine, ids, [parse_policy(n) for n in names], 0.5)}
    assert res["static:0.25"].expert_mb * 1e6 <= 0.25 * fp16
    assert 0.25 * fp16 < res["pagedweight:0.25"].expert_mb * 1e6 <= 0.25 * 1.5 * fp16
    assert res["pagedweight:0.25"].kl < res["static:0.25"].kl
    for r in res.values():
        assert r.kl_ci[0] <= r.kl <= r.kl_ci[1] + 1e-12
