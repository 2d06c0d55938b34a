"""The bundled models, trained here on real text: convert + generate end to end, 8-bit fidelity."""

import json

import pytest
import torch
from typer.testing import CliRunner

from pwctl.checkpoint import EVAL_SAMPLE, MODELS_DIR, bundled_models
from pwctl.cli import app
from pwctl.convert import ConvertOptions, convert
from pwctl.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine import Engine
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
