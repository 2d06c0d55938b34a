"""`pwctl bench --throughput` end to end through typer on the bundled tiny-mixtral (CPU, tiny
sizes): the JSON report is complete and self-consistent, a small memory budget makes pagedweight
demote during the run, and bad input exits 2 with a clear message. The bursty load keeps its
phases, a trace file runs (a malformed one fails naming its line), moves per 1k tokens and mean
bits agree with the counters and widths, and the served-quality KL is the direct computation."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from pwctl.bench import throughput as tp
from pwctl.bench.serving_budget import BudgetCalculator
from pwctl.build.checkpoint import EVAL_SAMPLE
from pwctl.cli import app
from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.engine import Engine

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
        assert r["moves_per_1k_tokens"] == 0
        bits = 16 if r["policy"] == "fp16" else 4
        assert r["bits_mean"] == r["bits_min"] == r["bits_max"] == bits
        assert r["timeline"]["bits"] == [bits] * len(r["timeline"]["t_s"])
        assert r["kl_samples"] == 0 and r["kl_mean"] is None  # no --quality-sample
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
    widest = Pack(bundled_pack).manifest.max_bits
    for r in report["results"]:
        check_consistent(r)
        assert r["memory_budget_bytes"] == budget and r["demotions"] > 0
        moves = r["demotions"] + r["promotions"]
        assert r["moves_per_1k_tokens"] == pytest.approx(1000 * moves / r["output_tokens"])
        assert 2 <= r["bits_min"] <= r["bits_mean"] <= r["bits_max"] <= widest
        assert r["bits_min"] < widest  # demoted below the widest at some step
        tl = r["timeline"]
        assert len(tl["t_s"]) == r["steps"] + 1  # a sample before the first step, one a step
        assert r["bits_mean"] == pytest.approx(np.mean(tl["bits"]))  # not thinned: few steps
        assert tl["output_tokens"][-1] == r["output_tokens"] and max(tl["kv_bytes"]) > 0
        assert tl["t_s"] == sorted(tl["t_s"]) and tl["t_s"][-1] <= r["seconds"]
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


def test_bursty_generator_alternates_short_and_long_phases():
    spec = tp.ThroughputSpec(64, 16, load="bursty", burst_phases=4, burst_short=2, burst_long=3)
    got = [(a.phase, a.input_len, a.output_len, a.at) for a in spec.arrivals("bursty")]
    short, long_ = (16, 8, 0.0), (64, 16, 0.0)
    assert got == [(p, *(long_ if p % 2 else short)) for p, n in enumerate((2, 3, 2, 3))
                   for _ in range(n)]  # fmt: skip
    assert spec.loads() == [("bursty", 3, 10)]  # in flight: the largest phase
    default = tp.bursty_arrivals(tp.ThroughputSpec(load="bursty"))  # 4 x 512/128, 32 x 2048/256
    assert [(a.input_len, a.output_len) for a in default] == [(512, 128)] * 4 + [
        (2048, 256)
    ] * 32 + [(512, 128)] * 4


def test_bursty_phases_wait_for_the_previous_one(bundled_pack):
    engine = Engine(Pack(bundled_pack))
    spec = tp.ThroughputSpec(32, 8, load="bursty", burst_phases=3, burst_short=2, burst_long=3)
    arrivals = spec.arrivals("bursty")
    batcher = engine.start_batching(parse_policy("uniform:4"), None, spec.batch_config(3, 7))
    prompts = tp.arrival_prompts(engine.tokenizer, EVAL_SAMPLE, arrivals)
    timeline = tp._Timeline(batcher, "cpu")
    seqs = tp._arrival_loop(batcher, timeline, prompts, arrivals)
    assert [len(s.prompt_ids) for s in seqs] == [a.input_len for a in arrivals]
    assert [len(s.output_ids) for s in seqs] == [a.output_len for a in arrivals]
    for phase in (1, 2):
        before = [s for s, a in zip(seqs, arrivals, strict=True) if a.phase == phase - 1]
        now = [s for s, a in zip(seqs, arrivals, strict=True) if a.phase == phase]
        ended = max(timeline.last[s.seq_id] for s in before)
        assert all(timeline.submit[s.seq_id] >= ended for s in now)
        assert all(timeline.first[s.seq_id] > ended for s in now)


def test_bursty_load_end_to_end(bundled_pack, tmp_path):
    report = bench(
        bundled_pack, tmp_path, "--load", "bursty", "--burst-phases", "3", "--burst-short", "2",
        "--burst-long", "3", "--policy", "uniform:4",
    )  # fmt: skip
    (r,) = report["results"]
    assert (r["mode"], r["load"], r["requests"]) == ("bursty", 3, 7)
    assert r["requested_tokens"] == r["output_tokens"] == 2 * 4 + 3 * 8 + 2 * 4
    assert r["prompt_tokens"] == 2 * 8 + 3 * 32 + 2 * 8 and r["cut_short"] == 0
    assert r["bits_mean"] == 4 and r["moves_per_1k_tokens"] == 0


def test_trace_file_runs(bundled_pack, tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = [{"at": 0.05, "input_len": 16, "output_len": 4}, {"at": 0, "input_len": 32,
             "output_len": 8}, {"at": 0, "input_len": 24, "output_len": 2}]  # fmt: skip
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    report = bench(bundled_pack, tmp_path, "--trace", str(trace), "--policy", "uniform:4")
    (r,) = report["results"]
    assert (r["mode"], r["requests"]) == ("trace", 3)
    assert r["output_tokens"] == r["requested_tokens"] == 14
    assert r["prompt_tokens"] == 72 and r["seconds"] >= 0.05


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ('{"at": 0, "input_len": 8}', "want the keys at, input_len, output_len"),
        ('{"at": -1, "input_len": 8, "output_len": 2}', "at -1: want seconds >= 0"),
        ('{"at": 0, "input_len": 0, "output_len": 2}', "input_len 0: want an integer >= 1"),
        ('{"at": 0, "input_len": 8, "output_len": 2.5}', "output_len 2.5: want an integer"),
        ("[1, 2]", "want the keys"),
    ],
)
def test_malformed_trace_fails_naming_the_line(bundled_pack, tmp_path, line, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"at": 0, "input_len": 8, "output_len": 2}\n' + line + "\n")
    r = runner.invoke(app, ["bench", str(bundled_pack), "--throughput", "--trace", str(trace)])
    assert r.exit_code == 2, r.output
    assert f"--trace {trace}:2: {message}" in r.output.replace("\n", ""), r.output


def test_kl_is_the_direct_computation():
    torch.manual_seed(0)
    ref, served = torch.randn(5, 50).log_softmax(-1), torch.randn(5, 50).log_softmax(-1)
    direct = F.kl_div(served, ref, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(tp.kl(ref, served), direct, atol=1e-6)
    assert torch.equal(tp.kl(ref, ref), torch.zeros(5))


def test_quality_sample_scores_served_steps_against_fp16(bundled_pack):
    engine = Engine(Pack(bundled_pack))
    reference = Engine(Pack(bundled_pack))
    reference.set_policy(parse_policy("fp16"))
    spec = tp.ThroughputSpec(32, 8, batches=(2,), quality_sample=4, warmup=False)
    samples: list = []
    results = tp.run_throughput(
        engine, [parse_policy("fp16"), parse_policy("uniform:3")], spec, EVAL_SAMPLE, samples
    )
    assert [r for r, _ in samples] == results
    tp.score_quality(reference, samples)
    fp16, low = results
    for r, got in samples:
        assert r.kl_samples == len(got.kept) == 4 and r.kl_seconds > 0
        assert all(s.finished for s, _, _ in got.kept)
        # the bench's mean equals torch's kl_div over the same served and reference rows
        direct = []
        for seq, pos, served in got.kept:
            assert len(seq.prompt_ids) <= pos < seq.num_tokens - 1  # a decode step's prefix
            ids = torch.tensor([seq.all_ids[: pos + 1]])
            ref = reference.logits(ids)[0, -1].log_softmax(-1)
            direct.append(F.kl_div(served, ref, log_target=True, reduction="sum").item())
        assert r.kl_mean == pytest.approx(np.mean(direct), rel=1e-4, abs=1e-7)
        assert r.kl_max == pytest.approx(max(direct), rel=1e-4, abs=1e-7)
    assert fp16.kl_mean < 1e-4  # served fp16 against the fp16 reference: the same model
    assert low.kl_mean > 100 * max(fp16.kl_mean, 1e-6)


def test_quality_sample_and_plot_end_to_end(bundled_pack, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "tp.png"
    report = bench(
        bundled_pack, tmp_path, "--batch", "2", "--policy", "uniform:4", "--quality-sample", "2",
        "--plot", str(png),
    )  # fmt: skip
    (r,) = report["results"]
    assert r["kl_samples"] == 2 and r["kl_mean"] > 0 and r["kl_seconds"] > 0
    ref = report["quality_reference"]
    assert ref["path"].startswith("store engine on cpu") and ref["load_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(bundled_pack, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    r = runner.invoke(
        app, ["bench", str(bundled_pack), "--throughput", *SIZES, "--plot", str(tmp_path / "p")]
    )
    assert r.exit_code == 2 and "--plot needs matplotlib" in r.output, r.output


def test_throughput_runs_without_longbench_libraries(bundled_pack, tmp_path, monkeypatch):
    """The GPU machine has no jieba / rouge / fuzzywuzzy / datasets: only LongBench's modes
    import them."""
    for name in ("jieba", "rouge", "fuzzywuzzy", "datasets"):
        monkeypatch.setitem(__import__("sys").modules, name, None)  # importing it fails
    for name in ("pwctl.bench.metrics", "pwctl.bench.longbench_data", "pwctl.bench.longbench"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    report = bench(bundled_pack, tmp_path, "--batch", "1", "--policy", "uniform:4")
    assert report["results"][0]["output_tokens"] == 8
