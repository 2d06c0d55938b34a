"""The commands end to end through typer, as a user runs them."""

import json
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pwctl.build import tiny
from pwctl.cli import app
from pwctl.errors import PwctlError
from pwctl.format.pack import Pack

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


class Loaded(Exception):
    """A command got past its option checks (the tests below patch the model load)."""


def _loaded(*args, **kwargs):
    raise Loaded


@pytest.fixture
def small_pack(packs, monkeypatch) -> Path:
    for target in ("pwctl.runtime.engine.engine.Engine", "pwctl.runtime.serve.server.run_server"):
        monkeypatch.setattr(target, _loaded)
    return packs[("mixtral", "fused")]


def test_limits_are_checked_at_the_door(small_pack, checkpoints, tmp_path):
    """Each bad value gets one error line and exit 2 before any model loads (these once ran
    out of memory, were accepted silently, or ended in a traceback)."""
    pack = str(small_pack)
    context = Pack(small_pack).manifest.config["max_position_embeddings"]
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [
        (["serve", pack, "--max-model-len", "1000000000"], f"must be in [1, {context}]"),
        (["serve", pack, "--max-model-len", str(context + 1)], "--max-model-len"),
        (["serve", pack, "--max-model-len", "0"], "--max-model-len 0"),
        (["serve", pack, "--max-model-len", "-5"], "--max-model-len -5"),
        (["serve", pack, "--max-seqs", "0"], "--max-seqs 0: must be at least 1"),
        (["serve", pack, "--max-batch-tokens", "0"], "--max-batch-tokens 0"),
        (["serve", pack, "--port", str(busy.getsockname()[1])], "cannot listen there"),
        (["serve", pack, "--device", "tpu"], "use cpu, cuda, cuda:N or auto"),
        (["convert", str(checkpoints[("mixtral", "fused")]), str(tmp_path / "o"),
          "--device", "tpu"], "--device 'tpu'"),
        (["generate", pack, "--prompt", "hi", "--device", "tpu"], "--device 'tpu'"),
        (["profile", pack, "--samples", "0"], "--samples 0"),
        (["profile", pack, "--seq-len", "-5"], "--seq-len -5"),
        (["bench", pack, "--ppl", "--seq-len", "0"], "--seq-len 0"),
        (["fit-residual", pack, "--test-split", "1.5"], "--test-split 1.5"),
        (["bench", pack, "--ppl", "--synthetic"], "not --ppl and --synthetic"),
    ]  # fmt: skip
    try:
        for args, said in cases:
            r = runner.invoke(app, args)
            assert r.exit_code == 2 and not isinstance(r.exception, Loaded), (args, r.output)
            assert said in r.output and len(r.output.strip().splitlines()) == 1, (args, r.output)
    finally:
        busy.close()


def test_bench_names_every_mode(small_pack):
    from pwctl.commands.bench import MODES

    for args in ([], ["--quantizer", "--planner"]):
        r = runner.invoke(app, ["bench", str(small_pack), *args])
        assert r.exit_code == 2 and all(m in r.output for m in MODES), r.output
    assert len(MODES) == 9


def test_bench_options_of_another_mode_are_an_error(small_pack):
    """An option that only other modes read is an error naming its modes and every mode, before
    any work (a mode's options: its module's `run` parameters)."""
    from pwctl.commands.bench import MODES

    pack, other = str(small_pack), "is an option of"
    cases = [
        (["bench", pack, "--ppl", "--input-len", "64"], f"--input-len {other} --throughput"),
        (["bench", "--predictions", "x.jsonl", "--rows", "8"], f"--rows {other} --quantizer"),
        (["bench", pack, "--throughput", "--tasks", "trec"], "of --longbench / --synthetic"),
        (["bench", "--planner", "--device", "cpu"], f"--device {other} --ppl / --longbench"),
    ]
    for args, said in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and said in r.output, (args, r.output)
        assert all(m in r.output for m in MODES) and len(r.output.strip().splitlines()) == 1


def test_bench_modes_read_the_options_the_command_declares():
    """Every option of `pwctl bench` is read by some mode, and each mode reads only options the
    command declares (the dispatch passes them by name)."""
    import inspect

    from pwctl.commands import bench

    declared = set(inspect.signature(bench.run).parameters) - {"ctx"}
    read = set().union(*(bench._options(m) for m in bench.MODES.values()))
    flags = {bench._name(m) for m in bench.MODES}
    assert read <= declared and declared - read == flags - {"predictions"}


def test_bench_modes_get_typed_values(monkeypatch, tmp_path):
    """A mode's `run` gets typer's converted values (a Path for --json), not click's raw strings:
    the device machine's click left `--json` a str in ctx.params and bench --kernels failed
    writing its rows."""
    from pwctl.commands import bench

    seen: dict = {}
    monkeypatch.setattr(bench.MODES["--planner"], "run", lambda json: seen.update(json=json))
    r = runner.invoke(app, ["bench", "--planner", "--json", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert seen["json"] == tmp_path / "p.json" and isinstance(seen["json"], Path)


def test_parse_device(monkeypatch):
    import pwctl.device as dev

    monkeypatch.setattr(dev, "_cuda_devices", lambda: 0)
    assert dev.parse_device("cpu") == dev.parse_device("auto") == "cpu"
    for bad in ("cuda", "cuda:0", "tpu", "cuda:", "cpu:0"):
        with pytest.raises(PwctlError):
            dev.parse_device(bad)
    monkeypatch.setattr(dev, "_cuda_devices", lambda: 2)
    assert dev.parse_device("auto") == "cuda" and dev.parse_device(" CUDA:1 ") == "cuda:1"
    with pytest.raises(PwctlError, match="2 CUDA device"):
        dev.parse_device("cuda:2")


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.strip() == f"pwctl {version('pwctl')}"


def test_cli_starts_without_torch_or_transformers():
    """`pwctl --help` and argument errors must not wait for the heavy imports (7-30 s)."""
    code = (
        "import sys, pwctl.cli; "
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
