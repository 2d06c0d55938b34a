"""Overlapped decode steps (engine/batcher.py): a decode step launches before the host has read
the last step's tokens, its inputs gathered on the device. On the CPU the fixed-shape forward of
the decode graphs runs eagerly, so the same overlap runs here: it must give the tokens, texts
and finish reasons of steps that read every token first, under stop tokens, stop strings,
seeded sampling, requests arriving mid-run (packed prefill steps between decode steps) and
preemption, and never run a row past a sequence's max_tokens."""

from __future__ import annotations

import pytest

from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig, Batcher
from pwctl.runtime.engine.decode_graphs import DecodeGraphs
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import SamplingParams, Sequence

PROMPTS = [
    "In the beginning God created",
    "The quick brown fox",
    "It is a truth universally acknowledged that a single man",
    "0123",
]


@pytest.fixture(scope="module")
def engine(bundled_pack) -> Engine:
    return Engine(Pack(bundled_pack))


def batcher_for(engine: Engine, overlap: bool, budget: str | None = None, **cfg) -> Batcher:
    """A CPU batcher whose decode steps run the graphs' fixed-shape forward (eagerly)."""
    config = BatchConfig(max_seqs=4, max_batch_tokens=64, block_size=4, overlap=overlap, **cfg)
    batcher = engine.start_batching(parse_policy("uniform:4"), budget, config)
    batcher.runner.graphs = DecodeGraphs(engine.model, batcher.kv, 4, capture=False)
    return batcher


class Rows:
    """Counts the rows each sequence ran and the steps that read tokens on the device."""

    def __init__(self, batcher: Batcher):
        self.rows: dict[int, int] = {}
        self.fed_steps = 0
        forward = batcher.runner.forward

        def counted(batch, fed=None):
            self.fed_steps += fed is not None
            for seq, n in zip(batch.seqs, batch.n_tokens, strict=True):
                self.rows[seq.seq_id] = self.rows.get(seq.seq_id, 0) + n
            return forward(batch, fed)

        batcher.runner.forward = counted  # type: ignore[method-assign]  # this instance only


def serve(batcher: Batcher, requests: list[tuple[list[int], SamplingParams]], late: int = 0):
    """Every request to completion; the last `late` of them join after the third step."""
    now, later = requests[: len(requests) - late], requests[len(requests) - late :]
    seqs = [batcher.add(ids, p) for ids, p in now]
    steps = 0
    while batcher.has_work or later:
        batcher.step()
        steps += 1
        if steps == 3:
            seqs += [batcher.add(ids, p) for ids, p in later]
            later = []
    return seqs


def outcome(seqs: list[Sequence]) -> list[tuple]:
    return [(s.output_ids, s.text, s.finish_reason, s.pending) for s in seqs]


def requests(engine: Engine) -> list[tuple[list[int], SamplingParams]]:
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    # a stop token the second prompt meets at its fourth greedy token
    stop_id = engine.generate_ids(ids[1], 4)[-1]
    return [
        (ids[0], SamplingParams(max_tokens=3, ignore_eos=True)),
        (ids[1], SamplingParams(max_tokens=12, stop_token_ids=(stop_id,), ignore_eos=True)),
        (ids[2], SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=7)),
        (ids[3], SamplingParams(max_tokens=14, stop=("\x00never",))),
        (ids[0], SamplingParams(max_tokens=6, ignore_eos=True)),
        (ids[2], SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)),
    ]


def test_overlapped_steps_give_what_reading_every_token_first_gives(engine):
    reqs = requests(engine)
    want = outcome(serve(batcher_for(engine, overlap=False), reqs, late=2))
    batcher = batcher_for(engine, overlap=True)
    rows = Rows(batcher)
    seqs = serve(batcher, reqs, late=2)
    assert outcome(seqs) == want
    assert rows.fed_steps > 5  # decode steps did read their tokens on the device
    assert batcher.kv.used == 0 and not batcher.has_work
    stopped = seqs[1]
    assert stopped.finish_reason == "stop" and len(stopped.output_ids) == 4
    for seq, (ids, _) in zip(seqs, reqs, strict=True):
        # a row for every token but the last; one thrown-away row at most after a stop token
        ran = rows.rows[seq.seq_id] - (len(ids) + len(seq.output_ids) - 1)
        assert ran == 0 or (seq.finish_reason == "stop" and ran == 1), (seq.seq_id, ran)


def test_overlap_under_preemption_equals_the_reference(engine):
    """Few KV blocks: sequences are preempted with a token still on the device and
    recomputed later; greedy outputs still equal transformers' generate."""
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    longest = max(len(i) for i in ids) + 10
    probe = batcher_for(engine, True, max_model_len=longest)
    blocks = probe.kv.blocks_for(longest) + 1
    budget = probe.memory.fixed + probe.memory.planes + blocks * probe.kv.block_bytes
    batcher = batcher_for(engine, True, f"{budget}b", max_model_len=longest)
    rows = Rows(batcher)
    seqs = serve(batcher, [(i, SamplingParams(max_tokens=10, ignore_eos=True)) for i in ids])
    assert batcher.scheduler.preemptions > 0 and rows.fed_steps > 0
    for seq in seqs:
        assert seq.output_ids == engine.generate_ids(seq.prompt_ids, 10)
        assert seq.finish_reason == "length" and seq.pending == 0
    assert batcher.kv.used == 0


def test_a_sequence_at_its_context_sits_the_next_step_out(engine):
    """A token on the device that fills the context ends its sequence: the overlapped next step
    runs no row for it (it would need a cache row past the context)."""
    ids = engine.tokenizer(PROMPTS[1]).input_ids
    limit = len(ids) + 5
    batcher = batcher_for(engine, True, max_model_len=limit)
    rows = Rows(batcher)
    seq, other = serve(batcher, [(ids, SamplingParams(max_tokens=5, ignore_eos=True)),
                                 (ids, SamplingParams(max_tokens=5, ignore_eos=True))])  # fmt: skip
    assert seq.finish_reason == other.finish_reason == "length" and len(seq.output_ids) == 5
    assert rows.rows[seq.seq_id] == limit - 1 and rows.fed_steps > 0


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["uniform:4", "pagedweight:0.3"])
def test_overlapped_graph_steps_on_cuda_equal_serial_ones(bundled_pack, policy):
    """On the GPU, replayed graphs reading their tokens on the device while the host lands the
    step before (a budgeted policy commits widths beside a running step too) give what steps
    that read every token first give."""
    import torch

    engine = Engine(Pack(bundled_pack), "cuda", torch.float16)
    reqs = requests(engine)
    got = {}
    for overlap in (False, True):
        cfg = BatchConfig(max_seqs=4, max_batch_tokens=64, block_size=4, overlap=overlap)
        batcher = engine.start_batching(parse_policy(policy), None, cfg)
        assert batcher.runner.graphs is not None
        rows = Rows(batcher)
        got[overlap] = outcome(serve(batcher, reqs, late=2))
        assert (rows.fed_steps > 5) == overlap and batcher.kv.used == 0
    assert got[True] == got[False]
