"""The commands end to end through typer, as a user runs them."""

import json

from typer.testing import CliRunner

from pwctl import tiny
from pwctl.cli import app

runner = CliRunner()


def test_convert_generate_bench(checkpoints, tmp_path):
    src = checkpoints[("mixtral", "per_expert")]
    out = tmp_path / "pack"
    r = runner.invoke(
        app,
        [
            "convert",
            str(src),
            str(out),
            "--min-bits",
            "3",
            "--max-bits",
            "6",
            "--json",
            str(tmp_path / "c.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["blocks"] == 2 * 4 * 3 and report["MB/s"] > 0

    r = runner.invoke(
        app,
        [
            "generate",
            str(out),
            "--prompt",
            "The earth",
            "--max-tokens",
            "5",
            "--policy",
            "uniform:4",
            "--json",
            str(tmp_path / "g.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "g.json").read_text())["policy"] == "uniform:4"

    data = tmp_path / "eval.txt"
    data.write_text(tiny.TOKENIZER_TEXT * 20)
    r = runner.invoke(
        app,
        [
            "bench",
            str(out),
            "--ppl",
            "--data",
            str(data),
            "--seq-len",
            "64",
            "--policy",
            "fp16",
            "--policy",
            "uniform:3",
            "--policy",
            "uniform:6",
            "--json",
            str(tmp_path / "b.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    rows = {x["policy"]: x for x in json.loads((tmp_path / "b.json").read_text())["results"]}
    assert rows["fp16"]["kl"] == 0 and rows["uniform:3"]["kl"] > rows["uniform:6"]["kl"] > 0
    assert (
        rows["uniform:3"]["expert_mb"] < rows["uniform:6"]["expert_mb"] < rows["fp16"]["expert_mb"]
    )

    r = runner.invoke(
        app, ["bench", str(out), "--ppl", "--data", str(data), "--policy", "uniform:2"]
    )
    assert r.exit_code == 2 and "widths 3..6" in r.output

    # --max-bits: a serving-time cap below the pack's widest width
    r = runner.invoke(
        app,
        ["generate", str(out), "--prompt", "The earth", "--max-tokens", "3",
         "--policy", "uniform:4", "--max-bits", "5", "--json", str(tmp_path / "g5.json")],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "g5.json").read_text())["max_bits"] == 5
    for args, said in (
        (["--policy", "uniform:6", "--max-bits", "5"], "serves widths 3..5 (--max-bits)"),
        (["--max-bits", "7"], "--max-bits 7: this pack holds widths 3..6"),
    ):
        r = runner.invoke(app, ["generate", str(out), "--prompt", "x", *args])
        assert r.exit_code == 2 and said in r.output, r.output
