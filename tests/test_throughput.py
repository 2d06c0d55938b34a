"""`pwctl bench --throughput` end to end through typer on the bundled tiny-mixtral (CPU, tiny
sizes): the JSON report is complete and self-consistent, a small memory budget makes pagedweight
demote during the run, and bad input exits 2 with a clear message."""

import json

import pytest
from typer.testing import CliRunner

from pwctl.bench.serving_budget import BudgetCalculator
from pwctl.cli import app
from pwctl.pack import Pack
from pwctl.runtime.batcher import BatchConfig

runner = CliRunner()
SIZES = ["--input-len", "32", "--output-len", "8"]


def bench(pack, tmp_path, *args: str) -> dict:
    out = tmp_path / "tp.json"
    r = runner.invoke(app, ["bench", str(pack), "--throughput", *SIZES, *args, "--json", str(out)])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def check_consistent(result: dict) -> None:
    assert result["output_tokens"] == result["requests"] * 8
    assert result["prompt_tokens"] == result["requests"] * 32
    assert result["aborted"] == 0 and result["output_tok_s"] > 0
    assert result["cut_short"] == 0 and result["requested_tokens"] == result["output_tokens"]
    assert result["total_tok_s"] > result["output_tok_s"]
    assert 0 < result["ttft_p50_s"] <= result["ttft_p90_s"] <= result["seconds"]
    assert 0 < result["ttft_mean_s"] <= result["seconds"]
    assert 0 < result["tpot_mean_s"] <= result["tpot_p90_s"] * 1.0001
    assert result["peak_memory_source"] == "accounted"
    assert result["peak_memory_bytes"] <= result["memory_budget_bytes"]
    assert result["peak_plane_bytes"] > 0 and result["peak_kv_bytes"] > 0


def test_fixed_policies_batch_and_concurrency(bundled_pack, tmp_path):
    report = bench(
        bundled_pack, tmp_path, "--batch", "1", "--batch", "2", "--concurrency", "2",
        "--policy", "fp16", "--policy", "uniform:4",
    )  # fmt: skip
    results = report["results"]
    got = [(r["policy"], r["mode"], r["load"], r["requests"]) for r in results]
    assert got == [
        (p, m, load, n)
        for p in ("fp16", "uniform:4")
        for m, load, n in (("batch", 1, 1), ("batch", 2, 2), ("concurrency", 2, 4))
    ]
    for r in results:
        check_consistent(r)
        assert r["demotions"] == r["promotions"] == 0  # fixed policies never move widths
    fp16, uniform = results[0], results[3]
    assert uniform["peak_plane_bytes"] < fp16["peak_plane_bytes"]


def test_pagedweight_demotes_under_a_small_budget(bundled_pack, tmp_path):
    # the widest planes (6 bits in this pack) leave room for the KV of one request only
    calc = BudgetCalculator(Pack(bundled_pack), "cpu")
    budget = calc.budget("uniform:6", BatchConfig(max_seqs=2, max_model_len=40), 1, 40)
    report = bench(
        bundled_pack, tmp_path, "--batch", "2", "--concurrency", "2", "--requests", "3",
        "--max-seqs", "2", "--policy", "pagedweight:0.4", "--memory-budget", f"{budget}b",
    )  # fmt: skip
    for r in report["results"]:
        check_consistent(r)
        assert r["memory_budget_bytes"] == budget and r["demotions"] > 0
    assert [r["requests"] for r in report["results"]] == [2, 3]


def test_max_bits_caps_the_planes_and_labels_the_rows(bundled_pack, tmp_path):
    # with no memory pressure pagedweight:0.6 holds every block near 6 bits; capped at 4 its
    # planes take 4-bit bytes at most, and each row names the cap
    args = ["--batch", "1", "--policy", "pagedweight:0.6"]
    free = bench(bundled_pack, tmp_path, *args)["results"][0]
    capped = bench(bundled_pack, tmp_path, *args, "--max-bits", "4")["results"][0]
    check_consistent(capped)
    assert (free["policy"], capped["policy"]) == ("pagedweight:0.6", "pagedweight:0.6 max-bits 4")
    at4 = sum(b.bytes_at(4) for b in Pack(bundled_pack).blocks)
    assert capped["peak_plane_bytes"] <= at4 < free["peak_plane_bytes"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "--batch / --concurrency 0: must be at least 1"),
        (["--input-len", "0"], "--input-len 0: must be at least 1"),
        (["--requests", "4"], "--requests N (N >= 1) goes with --concurrency C"),
        (["--input-len", "4000", "--output-len", "200"], "exceeds the model's context"),
        (["--memory-budget", "1MB"], "smallest budget that starts"),
    ],
)
def test_bad_input_exits_2(bundled_pack, args, message):
    r = runner.invoke(app, ["bench", str(bundled_pack), "--throughput", *args])
    assert r.exit_code == 2 and message in r.output, r.output


def test_missing_pack_exits_2(tmp_path):
    r = runner.invoke(app, ["bench", "--throughput", *SIZES])
    assert r.exit_code == 2 and "bench --throughput needs a PACK" in r.output
    r = runner.invoke(app, ["bench", str(tmp_path / "nope"), "--throughput", *SIZES])
    assert r.exit_code == 2 and "no such pack" in r.output
