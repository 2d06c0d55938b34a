"""The bundled models, trained here on real text: convert + generate end to end, 8-bit fidelity."""

import json

import pytest
import torch
from typer.testing import CliRunner

from pwctl.build.checkpoint import EVAL_SAMPLE, MODELS_DIR, bundled_models
from pwctl.build.convert import ConvertOptions, convert
from pwctl.cli import app
from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.engine import Engine
from pwctl.text import token_windows

runner = CliRunner()
EVAL = EVAL_SAMPLE


def test_bundled_models_are_installed_and_small():
    assert {"tiny-mixtral", "tiny-qwen-moe"} <= set(bundled_models())
    total = sum(f.stat().st_size for f in MODELS_DIR.rglob("*") if f.is_file())
    assert total <= 24_000_000


def test_convert_and_generate_by_bare_name(tmp_path):
    out = tmp_path / "pack"
    r = runner.invoke(app, ["convert", "tiny-mixtral", str(out)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app,
        [
            "generate",
            str(out),
            "--prompt",
            "In the beginning God",
            "--max-tokens",
            "8",
            "--json",
            str(tmp_path / "g.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    completion = json.loads((tmp_path / "g.json").read_text())["completion"]
    assert len(completion.strip()) > 0


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen-moe"])
def test_kl_at_8_bits_on_eval_text(name, tmp_path):
    convert(name, tmp_path / "pack", ConvertOptions())
    engine = Engine(Pack(tmp_path / "pack"))
    ids = token_windows(engine.tokenizer, EVAL, 256, 1024)
    engine.set_policy(parse_policy("fp16"))
    ref = torch.log_softmax(engine.logits(ids), -1)
    nll = -ref[:, :-1].gather(2, ids[:, 1:, None]).mean()
    assert float(nll.exp()) < 100, "a trained model, far better than uniform over 4096"
    engine.set_policy(parse_policy("uniform:8"))
    out = torch.log_softmax(engine.logits(ids), -1)
    kl = float((ref.exp() * (ref - out)).sum(-1).mean())
    assert kl < 1e-3


def test_results_run_the_budgets_each_pack_can_hold(bundled_qwen_pack, tmp_path):
    # tiny-qwen-moe's downs have 32 columns, stored in 128-column rows: at 2 bits its blocks
    # take more than 0.2 of the fp16 bytes, so `bench --results` runs its budgets from 0.3
    from pwctl.bench.results import BUDGETS, feasible_budgets
    from pwctl.errors import PwctlError

    for name in ("tiny-mixtral", "tiny-qwen-moe"):  # widths 2..8
        convert(name, tmp_path / name, ConvertOptions(force=True))
    for name, skipped in (("tiny-mixtral", ()), ("tiny-qwen-moe", (0.2,))):
        budgets, floor = feasible_budgets(Pack(tmp_path / name))
        assert budgets == [b for b in BUDGETS if b not in skipped]
        assert all(b < floor for b in skipped) and floor <= budgets[0]
    with pytest.raises(PwctlError, match="past the 0.3"):  # widths 3..6: 0.36 at 3 bits
        feasible_budgets(Pack(bundled_qwen_pack))
