"""Decode steps in fixed shapes (engine/decode_graphs.py): on the CPU the fixed-shape forward a
CUDA graph captures runs eagerly and must give the packed-row path's logits and policy signals,
step for step (padded rows, padded cache rows, every architecture); on CUDA the replayed graphs
must give the eager engine's logits and tokens, also after a re-capture."""

from __future__ import annotations

import pytest
import torch

from pwctl.build import tiny
from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.decode_graphs import MIN_BLOCKS, DecodeGraphs, bucket
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import SamplingParams

PROMPTS = [
    "In the beginning God created",
    "The quick brown fox",
    "It is a truth universally acknowledged that a single man in possession",
]


def test_buckets():
    assert [bucket(n, 6) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 4, 6, 6]
    assert [bucket(n) for n in (1, 7, 8, 9)] == [1, 8, 8, 16]


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Relative error (Frobenius norm) at most `tol`: on CUDA the two paths attend through
    different SDPA backends in fp16, so single small logits may differ past an elementwise bound
    (one of 8192 by 0.0204 against 0.02 in a GPU run); test_paged_engine compares the same way."""
    err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def checked_run(engine: Engine, policy: str, graphs_factory, tol: float, agree: float = 1.0):
    """Serve PROMPTS; every step the graphs fit runs both ways (the fixed-shape step first,
    then the packed rows, which rewrite the same cache rows with the same keys and values):
    the logits and the tap's signals must agree within `tol` (routing: on at least `agree` of
    the choices, the weights compared where both chose the same). Returns the shapes run."""
    cfg = BatchConfig(max_seqs=4, max_batch_tokens=256, block_size=4)  # one prefill step
    batcher = engine.start_batching(parse_policy(policy), None, cfg)
    runner = batcher.runner
    graphs = graphs_factory(engine, batcher)
    runner.graphs = None  # the packed rows below run eagerly
    packed, shapes = runner.forward, []

    def both(batch, fed=None):  # the batcher feeds nothing: runner.graphs is None
        if not graphs.fits(batch):
            return packed(batch)
        got = graphs.forward(batch).clone()
        got_seen = dict(batcher.tap.seen) if batcher.tap is not None else {}
        want = packed(batch)
        close(got, want, tol)
        for layer, (x, index, weights) in got_seen.items():
            wx, wi, ww = batcher.tap.seen[layer]
            same = index == wi
            assert x.shape == wx.shape and weights.shape == ww.shape
            assert same.float().mean() >= agree
            close(x, wx, tol)  # the inputs and weights where the tap keeps them ([T, 0] else)
            if weights.numel():
                close(weights[same], ww[same], tol)
        shapes.append((len(batch.seqs), max(s.num_computed + 1 for s in batch.seqs)))
        return want

    runner.forward = both
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 20, 12)]
    seqs = [batcher.add(i, p) for i, p in zip(ids, params, strict=True)]
    while batcher.has_work:
        batcher.step()
    assert all(len(s.output_ids) == p.max_tokens for s, p in zip(seqs, params, strict=True))
    return graphs, shapes


def eager_graphs(engine, batcher):
    return DecodeGraphs(engine.model, batcher.kv, 4, capture=False)


@pytest.mark.parametrize("experts", ["store", "paged"])
def test_fixed_shape_decode_equals_packed_rows(bundled_pack, experts):
    """Three sequences (padded to 4 rows), then two, then one; lengths across several L
    buckets; a budgeted policy, so the tap's signals are checked too (real rows only)."""
    engine = Engine(Pack(bundled_pack), experts=experts)
    assert engine.start_batching(parse_policy("uniform:4")).runner.graphs is None  # CPU
    graphs, shapes = checked_run(engine, "pagedweight:0.3", eager_graphs, 1e-5)
    assert graphs.replays == graphs.captures == 0  # no capture on the CPU
    assert {s for s, _ in shapes} == {1, 2, 3}
    block = engine.batcher.kv.block_size
    assert max(n for _, n in shapes) > MIN_BLOCKS * block  # crossed into a second L bucket


def test_failed_capture_falls_back_to_packed_rows(bundled_pack, monkeypatch, caplog):
    """A capture that raises (an op that syncs the host, say) costs nothing but speed: that step
    runs the fixed-shape forward eagerly, every later one the packed rows, with a warning."""
    engine = Engine(Pack(bundled_pack), experts="paged")
    cfg = BatchConfig(max_seqs=4, block_size=4)
    batcher = engine.start_batching(parse_policy("uniform:4"), None, cfg)
    graphs = DecodeGraphs(engine.model, batcher.kv, 4, capture=False)
    graphs.capture = True  # as on CUDA, with a capture that fails

    def broken(inputs, tap):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", broken)
    batcher.runner.graphs = graphs
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    got = [s.output_ids for s in batcher.run(ids, SamplingParams(max_tokens=6))]
    assert graphs.disabled and "not permitted" in graphs.disabled and graphs.replays == 0
    assert "run eagerly" in caplog.text
    batcher = engine.start_batching(parse_policy("uniform:4"), None, cfg)  # no graphs (CPU)
    assert got == [s.output_ids for s in batcher.run(ids, SamplingParams(max_tokens=6))]


def test_decode_builds_kept_per_token_count_until_widths_change(bundled_pack):
    # the graphs' key: steps alternating between S buckets read their builds from the cache,
    # and a width upload makes them afresh
    engine = Engine(Pack(bundled_pack), experts="paged")
    fused = engine.paged.fused
    one, four = fused.decode_builds(1), fused.decode_builds(4)
    assert fused.decode_builds(1) is one and fused.decode_builds(4) is four
    assert len(one) == len(fused.block_ids)
    engine.set_policy(parse_policy("uniform:3"))  # a width upload
    assert fused.decode_builds(1) is not one


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_fixed_shape_decode_every_arch(arch, packs):
    engine = Engine(Pack(packs[(arch, "per_expert")]), experts="paged")
    _, shapes = checked_run(engine, "uniform:4", eager_graphs, 1e-5)
    assert {s for s, _ in shapes} == {1, 2, 3}


# --- CUDA (skipped without a device) ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_graph_replay_equals_eager_on_cuda(arch, packs):
    """Replayed graphs against the eager packed rows on the same GPU, step for step; the
    engine's own graphs give the eager engine's tokens."""
    engine = Engine(Pack(packs[(arch, "per_expert")]), "cuda", torch.float16)

    def own(engine, batcher):  # the engine's own, on the builds of the widths in use
        return batcher.runner.graphs

    graphs, shapes = checked_run(engine, "uniform:4", own, 1e-2)
    assert graphs.disabled is None and graphs.replays == len(shapes)
    assert 3 <= graphs.captures == len(graphs._graphs)  # S: 4 (3 padded), 2, 1 at least
    assert graphs.stats()["decode_graph_capture_s"] > 0
    outs = []
    for on in (True, False):
        cfg = BatchConfig(max_seqs=4, block_size=4, cuda_graphs=on)
        batcher = engine.start_batching(parse_policy("uniform:3"), None, cfg)
        ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
        outs.append([s.output_ids for s in batcher.run(ids, SamplingParams(max_tokens=16))])
        assert (batcher.runner.graphs is not None) == on
        if on:
            assert batcher.metrics()["decode_graph_replays"] > 0
    assert outs[0] == outs[1]


@pytest.mark.gpu
def test_graph_replay_records_the_policy_signals_on_cuda(bundled_pack):
    """A budgeted policy: the graphs also write the tap's routing and inputs (shared output
    buffers), which must be what the eager step records, padded rows dropped."""
    engine = Engine(Pack(bundled_pack), "cuda", torch.float16)

    def own(engine, batcher):
        return batcher.runner.graphs

    graphs, shapes = checked_run(engine, "pagedweight:0.3", own, 1e-2, agree=0.95)
    assert graphs.disabled is None and graphs.replays == len(shapes) and graphs._seen


@pytest.mark.gpu
def test_graph_recaptured_when_builds_change(bundled_pack):
    """A new build signature captures a new graph; the old one is replayed again when the
    signature comes back; both give the eager logits."""
    engine = Engine(Pack(bundled_pack), "cuda", torch.float16)
    builds = ["a"]
    cfg = BatchConfig(max_seqs=4, max_batch_tokens=32, block_size=4)
    batcher = engine.start_batching(parse_policy("uniform:4"), None, cfg)
    graphs = DecodeGraphs(engine.model, batcher.kv, 4, lambda T: (builds[0],))
    packed, shapes = batcher.runner.forward, []
    batcher.runner.graphs = None

    def both(batch, fed=None):  # the signature flips before every decode step
        if not graphs.fits(batch):
            return packed(batch)
        builds[0] = "b" if builds[0] == "a" else "a"
        got = graphs.forward(batch).clone()
        want = packed(batch)
        close(got, want, 1e-2)
        shapes.append(len(batch.seqs))
        return want

    batcher.runner.forward = both
    ids = [engine.tokenizer(PROMPTS[0]).input_ids]
    batcher.run(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    # two L buckets at most here, each under both signatures: captured once, then replayed
    assert len(shapes) == graphs.replays == 11
    assert 2 <= graphs.captures == len(graphs._graphs) <= 4
