"""No option value gives a traceback. Hypothesis drives every command's options through typer;
each run must end in a clean error (exit 2: one `error:` line of ours, or click's usage error)
or get past every check to the point where it would load a model, which is patched to raise
`Loaded` (so no model loads and the whole test takes well under a minute)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pwctl.build import tiny
from pwctl.build.convert import ConvertOptions, convert
from pwctl.cli import app

runner = CliRunner()
EXAMPLES = int(os.environ.get("PWCTL_FUZZ_EXAMPLES", "80"))  # per test; a few ms a run


class Loaded(Exception):
    """The command passed its checks: here it would read a checkpoint or load a model."""


def _loaded(*args: object, **kwargs: object) -> None:
    raise Loaded


# where each command's real work starts (modules the commands import in their bodies)
WORK = (
    "pwctl.runtime.engine.engine.Engine",
    "pwctl.build.convert.resolve_source",
    "pwctl.build.residual.fit",
    "pwctl.build.tiny.make_checkpoint",
    "pwctl.bench.planner.run_planner_bench",
    "pwctl.bench.quantizer.run_quantizer_bench",
    "pwctl.bench.longbench.run_predictions",
    "pwctl.bench.results.run_results",
    "pwctl.runtime.serve.server.run_server",
)

SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
def no_work(monkeypatch):
    for target in WORK:
        monkeypatch.setattr(target, _loaded)


def _float_text(x: float) -> str:
    return str(x) if math.isfinite(x) else {"inf": "inf", "-inf": "-inf"}.get(str(x), "nan")


TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12)
INTS = st.one_of(
    st.integers(-3, 20), st.integers(-(2**40), 2**40), st.sampled_from([64, 128, 256, 4096])
).map(str)
FLOATS = st.one_of(st.floats(), st.sampled_from([0.0, 0.2, 0.5, 1.0, -0.1])).map(_float_text)
DEVICES = st.one_of(
    st.sampled_from(["cpu", "auto", "cuda", "cuda:0", "cuda:3", "CPU", "tpu", "cuda:x", ""]), TEXT
)
POLICIES = st.one_of(
    st.sampled_from(
        ["fp16", "uniform:4", "uniform:9", "pagedweight:0.3", "static:800MB", "static", "x"]
    ),
    TEXT,
)
BUDGETS = st.one_of(st.sampled_from(["0.5", "800MB", "99999999TB", "0", "-1", "2", "1e3"]), TEXT)
FLAG = st.none()


def command_args(name: str, positional: list, options: dict) -> st.SearchStrategy[list[str]]:
    """[name, *positional, and a random subset of options]; a None value is a bare flag."""

    @st.composite
    def build(draw) -> list[str]:
        out = [name] + [draw(p) for p in positional]
        for option, values in options.items():
            if draw(st.booleans()):
                value = draw(values)
                out += [option] if value is None else [option, value]
        return out

    return build()


def assert_clean(args: list[str]) -> None:
    r = runner.invoke(app, args)
    if isinstance(r.exception, Loaded):
        return
    assert r.exit_code == 2, (args, r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output, (args, r.output)
    ours = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert ours or "Usage:" in r.output, (args, r.output)
    if ours:  # one line, nothing else
        assert r.output.strip() == ours[0], (args, r.output)


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "file.txt").write_text("the earth " * 50)
    ckpt = tiny.make_checkpoint("mixtral", root / "ckpt", hidden=32, layers=1, experts=2)
    convert(ckpt, root / "pack", ConvertOptions(max_bits=3))
    return {
        "pack": str(root / "pack"),
        "ckpt": str(ckpt),
        "file": str(root / "file.txt"),
        "missing": str(root / "missing"),
        "new": str(root / "new"),
    }


def paths(places: dict[str, str], *names: str) -> st.SearchStrategy[str]:
    return st.sampled_from([places[n] for n in names])


def test_convert(places, no_work):
    @SETTINGS
    @given(
        command_args(
            "convert",
            [paths(places, "ckpt", "missing"), paths(places, "new", "pack", "file")],
            {
                "--min-bits": INTS,
                "--max-bits": INTS,
                "--device": DEVICES,
                "--calib": paths(places, "file", "missing"),
                "--calib-tokens": INTS,
                "--table-group": INTS,
                "--force": FLAG,
                "--no-reference": FLAG,
            },
        )
    )
    def run(args):
        assert_clean(args)

    run()


def test_profile_and_fit_residual(places, no_work):
    pack = paths(places, "pack", "missing", "file")

    @SETTINGS
    @given(
        st.one_of(
            command_args(
                "profile",
                [pack],
                {
                    "--data": paths(places, "file", "missing"),
                    "--samples": INTS,
                    "--seq-len": INTS,
                    "--method": st.one_of(st.sampled_from(["measured", "proxy"]), TEXT),
                    "--device": DEVICES,
                },
            ),
            command_args("fit-residual", [pack], {"--test-split": FLOATS}),
        )
    )
    def run(args):
        assert_clean(args)

    run()


def test_generate_and_serve(places, no_work):
    pack = paths(places, "pack", "missing")
    shared = {
        "--policy": POLICIES,
        "--memory-budget": BUDGETS,
        "--max-bits": INTS,
        "--device": DEVICES,
        "--eager": FLAG,
        "--no-verify": FLAG,
    }
    generate = {"--prompt": TEXT, "--max-tokens": INTS}

    @SETTINGS
    @given(
        st.one_of(
            command_args("generate", [pack], shared | generate).map(
                lambda a: a if "--prompt" in a else [*a, "--prompt", "hi"]
            ),
            command_args(
                "serve",
                [pack],
                shared
                | {
                    "--port": st.one_of(INTS, st.just("0"), st.just("65536")),
                    "--api-key": TEXT,
                    "--max-queue": INTS,
                    "--max-seqs": INTS,
                    "--max-batch-tokens": INTS,
                    "--max-model-len": INTS,
                    "--max-request-bytes": INTS,
                    "--metrics-auth": FLAG,
                },
            ),
        )
    )
    def run(args):
        assert_clean(args)

    run()


def test_bench(places, no_work):
    modes = ["--ppl", "--longbench", "--synthetic", "--throughput", "--kernels", "--quantizer",
             "--planner", "--results"]  # fmt: skip

    @SETTINGS
    @given(
        command_args(
            "bench",
            [],
            {m: FLAG for m in modes}
            | {
                "--predictions": paths(places, "file", "missing"),
                "--data": paths(places, "file", "missing"),
                "--policy": POLICIES,
                "--rtn": INTS,
                "--seq-len": INTS,
                "--kv-peak": FLOATS,
                "--max-tokens": INTS,
                "--max-bits": INTS,
                "--device": DEVICES,
                "--rows": INTS,
                "--cols": INTS,
                "--tasks": TEXT,
                "--lengths": INTS,
                "--depths": FLOATS,
                "--examples": INTS,
                "--input-len": INTS,
                "--output-len": INTS,
                "--batch": INTS,
                "--concurrency": INTS,
                "--requests": INTS,
                "--max-seqs": INTS,
                "--memory-budget": BUDGETS,
                "--shape": TEXT,
                "--width": TEXT,
                "--tokens": INTS,
            },
        ).flatmap(
            lambda a: st.sampled_from([[a[0], places["pack"], *a[1:]], a])  # with or without PACK
        )
    )
    def run(args):
        assert_clean(args)

    run()


def test_demo(places, no_work, tmp_path):
    work = st.sampled_from([str(tmp_path / "work"), places["file"]])

    @SETTINGS
    @given(
        command_args(
            "demo", [], {"--model": st.one_of(st.just("tiny-mixtral"), TEXT), "--max-tokens": INTS}
        ).map(lambda a: a + ["--workdir", str(Path(places["file"]).parent / "demo")]),
        work,
    )
    def run(args, workdir):
        assert_clean([*args[:-1], workdir])

    run()
