"""Widths move without thrash (issue 59): plane memory goes back to the planes only once the
spare bytes stay above the watermark for `hold` steps, at most `cap` of the arena a step, and
after a burst every block returns to the widest width within a bounded number of steps."""

import numpy as np

from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import SamplingParams
from pwctl.runtime.memory.budget import MemoryBudget

CFG = BatchConfig(max_seqs=8, max_batch_tokens=64, block_size=4, max_model_len=96)


def pressed(bundled_pack) -> tuple[Engine, MemoryBudget]:
    """A pagedweight engine right after a burst: planes demoted for KV blocks now free."""
    engine = Engine(Pack(bundled_pack))
    probe = engine.start_batching(parse_policy("pagedweight:0.4"), None, CFG)
    budget = probe.memory.fixed + engine.widest_plane_bytes() + 12 * probe.kv.block_bytes
    batcher = engine.start_batching(parse_policy("pagedweight:0.4"), f"{budget}b", CFG)
    prompts = ["In the beginning", "The quick brown fox", "It is a truth", "0123 4567"] * 2
    ids = [engine.tokenizer(p).input_ids for p in prompts]
    engine.generate_batch(ids, SamplingParams(max_tokens=24, ignore_eos=True))
    memory = batcher.memory
    assert memory.moves.demotions > 0 and memory.planes < engine.widest_plane_bytes()
    return engine, memory


def idle_steps(engine: Engine, memory: MemoryBudget, kv_wanted, n: int) -> list[int]:
    """`n` idle steps at `kv_wanted(step)` KV blocks wanted; the plane bytes after each."""
    out = []
    for step in range(n):
        engine.allocator.planner.tick()
        memory.rebalance(kv_wanted(step))
        out.append(memory.planes)
    return out


def test_a_spare_signal_wavering_at_the_watermark_moves_no_width(bundled_pack):
    engine, memory = pressed(bundled_pack)
    for _ in range(40):  # let the planner's cooldown pass: only the rule holds widths now
        engine.allocator.planner.tick()
    block = memory.kv.block_bytes
    # KV wanted such that the spare bytes sit just above / just below the watermark
    mark = memory.promotion.watermark * memory.space
    room = (memory.space - memory.planes - mark) / block
    above, below = int(room) - 1, int(room) + 2
    before = memory.moves.promotions
    planes = idle_steps(engine, memory, lambda s: above if s % 2 else below, 40)
    assert memory.moves.promotions == before and len(set(planes)) == 1
    # held above the mark: promotions start once it has held for `hold` steps in a row (the
    # wavering left a run of one step above it)
    hold, start = memory.promotion.hold, memory.planes
    planes = idle_steps(engine, memory, lambda s: above, hold)
    assert planes[hold - 3] == start and memory.moves.promotions > before and planes[-1] > start


def test_promotions_take_at_most_the_cap_a_step(bundled_pack):
    engine, memory = pressed(bundled_pack)
    cap = memory.promotion.cap * memory.space
    for _ in range(40):
        engine.allocator.planner.tick()
    planes = [memory.planes, *idle_steps(engine, memory, lambda s: 0, 30)]
    steps = np.diff(planes)
    assert steps.max() > 0 and steps.max() <= cap and steps.min() >= 0


def test_widths_recover_after_a_burst_within_bounded_steps(bundled_pack):
    engine, memory = pressed(bundled_pack)
    rule, cooldown = memory.promotion, engine.allocator.planner.cfg.cooldown
    bound = cooldown + rule.hold + int(np.ceil(1 / rule.cap)) + 4
    idle_steps(engine, memory, lambda s: 0, bound)
    top = engine.store.max_bits
    assert (engine.store.widths == top).all(), np.bincount(engine.store.widths)
    assert memory.planes == engine.widest_plane_bytes()


def test_demotions_leave_headroom_so_a_growing_cache_demotes_rarely(bundled_pack, monkeypatch):
    """A KV cache growing a block or two a step: with `headroom` each demotion frees room for
    several steps, so widths change less often than without it (each change waits for the
    device), and the demoted bytes stay within the headroom of what was asked."""
    import pwctl.runtime.memory.budget as budget_module

    Rule = budget_module.PromotionRule

    def run(headroom: float) -> tuple[int, MemoryBudget]:
        rule = Rule(headroom=headroom)
        monkeypatch.setattr(budget_module, "PromotionRule", lambda: rule)
        engine = Engine(Pack(bundled_pack))
        probe = engine.start_batching(parse_policy("pagedweight:0.4"), None, CFG)
        budget = probe.memory.fixed + engine.widest_plane_bytes() + 12 * probe.kv.block_bytes
        changes: list[int] = []
        batcher = engine.start_batching(
            parse_policy("pagedweight:0.4"), f"{budget}b", CFG, lambda w: changes.append(1)
        )
        prompts = ["In the beginning", "The quick brown fox", "It is a truth", "0123 4567"] * 2
        ids = [engine.tokenizer(p).input_ids for p in prompts]
        out = engine.generate_batch(ids, SamplingParams(max_tokens=24, ignore_eos=True))
        assert all(len(s.output_ids) == 24 for s in out)
        return len(changes), batcher.memory

    without, m0 = run(0.0)
    with_room, m1 = run(0.015)
    assert m1.moves.demotions > 0 and with_room < without, (with_room, without)
    assert m1.promotion.headroom == 0.015 and m0.promotion.headroom == 0.0
    try:
        Rule(headroom=0.02)
    except ValueError as e:
        assert "below the watermark" in str(e)
    else:
        raise AssertionError("a headroom at the watermark would be promoted back")


def test_memory_to_spare_at_the_widest_widths_makes_no_plan(bundled_pack, monkeypatch):
    """With every block at the widest width there is nothing to promote: no plan is made,
    however long the spare bytes stay above the watermark (a plan a step was host work beside
    every step)."""
    engine, memory = pressed(bundled_pack)
    rule, cooldown = memory.promotion, engine.allocator.planner.cfg.cooldown
    idle_steps(engine, memory, lambda s: 0, cooldown + rule.hold + int(np.ceil(1 / rule.cap)) + 4)
    assert (engine.store.widths == engine.allocator.widest).all()
    fits = []
    monkeypatch.setattr(engine.allocator, "fit", lambda b: fits.append(b) or memory.widths)
    idle_steps(engine, memory, lambda s: 0, 3 * rule.hold)
    assert fits == [] and (engine.store.widths == engine.allocator.widest).all()
