"""The continuous-batching engine equals the single-sequence reference path (transformers'
own attention and generate) on every architecture, under chunked prefill and preemption, and
shares one memory budget between expert planes and KV blocks."""

import numpy as np
import pytest
import torch

from pwctl.build import tiny
from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import SamplingParams, Sequence

PROMPTS = [
    "In the beginning God created",
    "The quick brown fox",
    "It is a truth universally acknowledged that a single man",
    "0123",
]


def greedy_equal(engine: Engine, n_tokens: int = 10) -> list[Sequence]:
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    seqs = engine.generate_batch(ids, SamplingParams(max_tokens=n_tokens))
    for seq in seqs:
        assert seq.output_ids == engine.generate_ids(seq.prompt_ids, n_tokens)
        assert seq.finish_reason in ("stop", "length")
    return seqs


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_greedy_and_logits_equal_reference_every_arch(arch, packs):
    engine = Engine(Pack(packs[(arch, "per_expert")]))
    # small blocks, a small token budget (chunked prefill) and few blocks (preemption): room
    # for the longest sequence and one block more
    longest = max(len(engine.tokenizer(p).input_ids) for p in PROMPTS) + 10
    cfg = BatchConfig(max_seqs=4, max_batch_tokens=7, block_size=4, max_model_len=longest)
    probe = engine.start_batching(parse_policy("uniform:4"), None, cfg)
    blocks = probe.kv.blocks_for(longest) + 1
    budget = probe.memory.fixed + probe.memory.planes + blocks * probe.kv.block_bytes
    batcher = engine.start_batching(parse_policy("uniform:4"), f"{budget}b", cfg)
    assert batcher.kv.pool.capacity == blocks
    seqs = greedy_equal(engine)
    assert batcher.scheduler.preemptions > 0 and batcher.kv.used == 0
    assert sum(s.preemptions for s in seqs) == batcher.scheduler.preemptions
    packed_prefill_logits_equal(engine)


def packed_prefill_logits_equal(engine: Engine) -> None:
    """Logits of one packed prefill step equal the reference path's, sequence for sequence."""
    engine.start_batching(parse_policy("uniform:4"), None, BatchConfig(block_size=2))
    runner, sched = engine.batcher.runner, engine.batcher.scheduler
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    for i in ids:
        sched.add(Sequence(i))
    logits = runner.forward(sched.schedule())
    for row, i in zip(logits, ids, strict=True):
        ref = engine.logits(torch.tensor([i]))[0, -1]
        torch.testing.assert_close(row, ref, rtol=1e-4, atol=1e-4)


def test_bundled_qwen_moe_equals_reference(bundled_qwen_pack):
    engine = Engine(Pack(bundled_qwen_pack))
    for policy in ("fp16", "uniform:3"):
        engine.start_batching(parse_policy(policy), None, BatchConfig(max_batch_tokens=16))
        assert any(s.text for s in greedy_equal(engine, 16))
    packed_prefill_logits_equal(engine)


@pytest.mark.parametrize("policy", ["fp16", "uniform:3", "static:0.5", "pagedweight:0.5"])
def test_bundled_model_policies_on_one_engine(policy, bundled_pack):
    engine = Engine(Pack(bundled_pack))
    engine.start_batching(parse_policy(policy), None, BatchConfig(max_batch_tokens=16))
    seqs = greedy_equal(engine, 16)
    assert any(len(s.text) > 0 for s in seqs)
    if policy == "fp16":
        packed_prefill_logits_equal(engine)


def test_memory_budget_demotes_under_kv_pressure_and_promotes_after(bundled_pack):
    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_seqs=8, max_batch_tokens=64, block_size=4, max_model_len=96)
    probe = engine.start_batching(parse_policy("pagedweight:0.4"), None, cfg)
    fixed, widest = probe.memory.fixed, engine.widest_plane_bytes()
    budget = fixed + widest + 12 * probe.kv.block_bytes  # full planes leave 12 KV blocks
    batcher = engine.start_batching(parse_policy("pagedweight:0.4"), f"{budget}b", cfg)
    memory = batcher.memory
    assert memory.planes == widest and batcher.kv.pool.limit == 12
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS * 2]
    seqs = engine.generate_batch(ids, SamplingParams(max_tokens=24, ignore_eos=True))
    assert all(s.finish_reason == "length" and len(s.output_ids) == 24 for s in seqs)
    moves = memory.moves
    assert moves.demotions > 0 and moves.demoted_bytes > 0
    # planes went down at most one width step per block past BUDGET (the planner's overshoot)
    assert memory.planes < widest and memory.planes >= 0.95 * engine.allocator.budget
    assert memory.total >= fixed + memory.planes + batcher.kv.pool.limit * batcher.kv.block_bytes
    pressed, peak_limit = memory.planes, batcher.kv.pool.limit
    assert batcher.kv.used == 0 and peak_limit > 12
    # KV drained: the planner promotes back as its cooldown allows
    for _ in range(40):
        engine.allocator.planner.tick()
        memory.rebalance(0)
    assert moves.promotions > 0 and moves.promoted_bytes > 0
    # back up (blocks whose profile shows no damage from a lower width may stay there)
    assert memory.planes > pressed and batcher.kv.pool.limit < peak_limit
    assert memory.total >= fixed + memory.planes + batcher.kv.pool.limit * batcher.kv.block_bytes


def test_fixed_policy_keeps_widths_and_checks_the_budget(bundled_pack):
    engine = Engine(Pack(bundled_pack))
    batcher = engine.start_batching(parse_policy("uniform:4"), None, BatchConfig(max_seqs=2))
    widths = engine.store.widths.copy()
    engine.generate_batch([engine.tokenizer("The earth").input_ids], SamplingParams(8))
    assert np.array_equal(widths, engine.store.widths) and batcher.memory.moves.demotions == 0
    with pytest.raises(PwctlError, match="smallest budget that starts"):
        engine.start_batching(parse_policy("fp16"), "1MB")
    with pytest.raises(PwctlError, match="exceeds the context"):
        engine.start_batching(parse_policy("fp16"), None, BatchConfig(max_model_len=8))
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=6))


def test_a_budget_past_the_widest_planes_gives_the_kv_cache_the_rest(bundled_pack):
    # pagedweight:0.6 asks for more plane bytes than every block at 6 bits holds: the planner's
    # BUDGET stops there, so the default memory budget (widest planes + a full context for every
    # sequence) holds every sequence's KV, as for uniform:6
    engine = Engine(Pack(bundled_pack))
    widest = engine.widest_plane_bytes()
    cfg = BatchConfig(max_seqs=2, max_batch_tokens=16)
    batcher = engine.start_batching(parse_policy("pagedweight:0.6"), None, cfg)
    assert engine.allocator.budget == widest
    full = cfg.max_seqs * -(-engine.model.config.max_position_embeddings // cfg.block_size)
    assert batcher.kv.pool.capacity == full


def test_each_steps_router_ids_reach_the_planner_once_a_step_late(bundled_pack):
    # the batcher feeds a step's signals while the next step runs (the planner's host work
    # overlaps the GPU); idle feeds the last one
    engine = Engine(Pack(bundled_pack))
    batcher = engine.start_batching(parse_policy("pagedweight:0.4"), None, BatchConfig(max_seqs=2))
    fed, feed = [], engine.allocator.feed
    engine.allocator.feed = lambda signals: (fed.append(signals.host()[0].copy()), feed(signals))
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS[:2]]
    for i in ids:
        engine.add_request(i, SamplingParams(max_tokens=3, ignore_eos=True))
    seen, ticks = [], engine.allocator.planner.step
    while batcher.has_work:
        batcher.step()
        assert len(fed) == len(seen)  # this step's signals wait for the next step
        layers = engine.allocator.layers
        seen.append(torch.stack([batcher.tap.seen[li][1].flatten() for li in layers]).numpy())
    batcher.idle()
    assert len(fed) == len(seen) >= 3
    assert all(np.array_equal(f, s) for f, s in zip(fed, seen, strict=True))
    assert engine.allocator.planner.step == ticks + len(seen) + 1  # one a step, one idle


def test_the_serving_tap_keeps_what_the_planner_reads(bundled_pack):
    # the routing always; the blocks' inputs only where the planner reads their norms (a
    # per-layer policy, a fitted residual), the routing weights never: what is not kept is an
    # empty [T, 0] view, which a decode graph copies at no cost
    from pwctl.format.residual import ResidualModel

    engine = Engine(Pack(bundled_pack))
    batcher = engine.start_batching(parse_policy("pagedweight:0.4"), None, BatchConfig(max_seqs=2))
    alloc = engine.allocator
    assert not alloc.reads_inputs and not batcher.tap.inputs and not batcher.tap.weights
    engine.add_request(engine.tokenizer(PROMPTS[0]).input_ids, SamplingParams(max_tokens=2))
    batcher.step()
    k = engine.model.config.num_experts_per_tok
    for layer in alloc.layers:
        x, index, weights = batcher.tap.seen[layer]
        T = index.shape[0]
        assert T > 1 and index.shape == (T, k) and x.shape == weights.shape == (T, 0)
    n = len(alloc.layers)
    alloc.residual = ResidualModel(
        alloc.layers, [1.0] * 3, [1.0] * 3, [[0.1, 0.1, 0.1]] * n, [0.0] * n, {"r2_test": 0.5}
    )
    assert alloc.reads_inputs
    engine.set_policy(parse_policy("dynamic-layer:0.4"))
    assert engine.allocator.reads_inputs


def test_one_token_steps_keep_the_last_residual(bundled_pack):
    # a usable residual model reads the std of a step's token norms: undefined for one token,
    # so a one-token step keeps the factor of the last step that had more
    from pwctl.format.residual import ResidualModel
    from pwctl.runtime.moe.block import MoETap

    engine = Engine(Pack(bundled_pack))
    engine.set_policy(parse_policy("pagedweight:0.4"))
    alloc = engine.allocator
    n = len(alloc.layers)
    alloc.residual = ResidualModel(
        alloc.layers, [1.0] * 3, [1.0] * 3, [[0.1, 0.1, 0.1]] * n, [0.0] * n, {"r2_test": 0.5}
    )
    factors = []
    for tokens in (5, 1):
        with MoETap(engine.model) as tap:
            engine.logits(torch.randint(1, 100, (1, tokens)))
        alloc.observe(tap)
        factors.append(alloc.planner._res_block.copy())
    assert np.isfinite(factors[0]).all() and not np.allclose(factors[0], 1.0)
    assert np.array_equal(factors[1], factors[0])


def test_text_catches_up_while_the_next_step_runs(bundled_pack):
    """A running sequence's newest token is decoded to text during the next step (beside its
    kernels on the GPU): between steps its text lags by at most that token; with stop strings
    the text is current after each step; a finished sequence has all of its text."""
    engine = Engine(Pack(bundled_pack))
    batcher = engine.start_batching(parse_policy("uniform:4"), None, BatchConfig(max_seqs=2))
    plain = batcher.add(engine.tokenizer(PROMPTS[0]).input_ids, SamplingParams(max_tokens=12))
    stops = SamplingParams(max_tokens=12, stop=["\x00never"])
    watched = batcher.add(engine.tokenizer(PROMPTS[1]).input_ids, stops)

    def text(seq: Sequence, n: int) -> str:
        return engine.tokenizer.decode(seq.output_ids[:n], skip_special_tokens=True)

    lagged = 0
    while batcher.has_work:
        batcher.step()
        for seq in (plain, watched):
            if seq.finished:
                assert seq.text == text(seq, len(seq.output_ids)) or seq.finish_reason == "stop"
            elif seq is watched and seq.output_ids:
                assert text(seq, len(seq.output_ids)).startswith(seq.text)
                assert len(seq.text) >= len(text(seq, len(seq.output_ids) - 1))
            elif seq.output_ids:
                assert text(seq, len(seq.output_ids) - 1).startswith(seq.text)
                lagged += seq.text != text(seq, len(seq.output_ids))
        batcher.catch_up_text()
        if not plain.finished and plain.output_ids:
            assert text(plain, len(plain.output_ids)).startswith(plain.text)
    assert lagged > 0 and plain.finished and watched.finished


def test_a_sequence_not_streamed_gets_its_text_once_at_the_end(bundled_pack):
    """`stream=False` (a whole response, bench, generate): no text while it runs, no decode a
    step; at the end the text a streamed twin got step by step."""
    engine = Engine(Pack(bundled_pack))
    batcher = engine.start_batching(parse_policy("uniform:4"), None, BatchConfig(max_seqs=2))
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    streamed = batcher.add(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    whole = batcher.add(ids, SamplingParams(max_tokens=12, ignore_eos=True, stream=False))
    while batcher.has_work:
        batcher.step()
        batcher.catch_up_text()
        if not whole.finished:
            assert whole.text == "" and whole.offsets.read == 0
    assert whole.output_ids == streamed.output_ids and whole.text == streamed.text
    assert whole.text == engine.tokenizer.decode(whole.output_ids, skip_special_tokens=True)


def test_a_step_out_of_device_memory_says_so_in_one_line(bundled_pack, monkeypatch):
    """On CUDA the allocator is capped at the budget: a step that passes it fails with the
    budget and the fixed part named, not a traceback from deep in torch."""
    engine = Engine(Pack(bundled_pack))
    batcher = engine.start_batching(parse_policy("uniform:4"), None, BatchConfig(max_seqs=2))
    batcher.add(engine.tokenizer(PROMPTS[0]).input_ids, SamplingParams(max_tokens=4))

    def out_of_memory(batch, fed=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB\nmore")

    monkeypatch.setattr(batcher.runner, "forward", out_of_memory)
    with pytest.raises(PwctlError, match=r"ran out of device memory within --memory-budget") as e:
        batcher.step()
    assert "\n" not in str(e.value) and "Tried to allocate 20.00 MiB" in str(e.value)
