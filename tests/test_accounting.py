"""One accounting of device memory (memory/accounting.py): `--memory-budget` parsed once, the
fixed part from shapes, the calculator and the engine agreeing, a budget for N sequences
admitting N sequences, the too-small-budget error naming a budget that then starts, and no
request cut short under tight budgets (BUDGET and the planner's floors give way first)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pwctl.bench.serving_budget import BudgetCalculator
from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.policy import BudgetArg, parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.decode_graphs import DecodeGraphs
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import SamplingParams
from pwctl.runtime.memory import accounting
from pwctl.runtime.memory.accounting import (
    SLACK,
    ModelShape,
    StepShape,
    over_budget,
    workspace,
)

QWEN_SHAPE = ModelShape(2048, 5632, 4, 32, 8, 64, 4096, 2)


def test_budget_arg_parses_sizes_and_fractions():
    assert BudgetArg.parse("12GiB").nbytes == 12 * 2**30
    assert BudgetArg.parse("800MB").nbytes == 800_000_000
    assert BudgetArg.parse(123).nbytes == 123
    assert BudgetArg.parse("0.5").fraction == 0.5
    assert BudgetArg.parse("0.5").resolve("cpu", 1000) == 500
    assert BudgetArg.parse(None) is None
    for bad in ("lots", "2", "0", "1.5x", "0.1b"):
        with pytest.raises(PwctlError, match="--memory-budget"):
            BudgetArg.parse(bad)


def test_workspace_grows_with_the_step_and_counts_the_graph_pool():
    small = workspace(QWEN_SHAPE, StepShape(4, 256, 2304, 16))
    big = workspace(QWEN_SHAPE, StepShape(32, 256, 2304, 16))
    graphs = workspace(QWEN_SHAPE, StepShape(32, 256, 2304, 16), graphs=True)
    assert big["step"] > small["step"] and big["logits_and_sampler"] > small["logits_and_sampler"]
    assert "decode_graph_pool" not in big and graphs["decode_graph_pool"] > 0
    longer = workspace(QWEN_SHAPE, StepShape(32, 256, 8192, 16))
    assert longer["step"] > big["step"]


def test_over_budget_allows_the_slack_only():
    assert not over_budget(int(1000 * (1 + SLACK)), 1000)
    assert over_budget(int(1000 * (1 + SLACK)) + 1, 1000)


@pytest.mark.parametrize("policy", ["uniform:4", "pagedweight:0.3"])
def test_a_too_small_budget_names_the_smallest_that_starts(bundled_pack, policy):
    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_seqs=2, max_batch_tokens=16, max_model_len=64)
    need = engine.smallest_budget(parse_policy(policy), cfg)
    with pytest.raises(PwctlError, match=f"the smallest budget that starts is {need}b"):
        engine.start_batching(parse_policy(policy), f"{need - 4096}b", cfg)
    batcher = engine.start_batching(parse_policy(policy), f"{need}b", cfg)
    # the one full-length sequence it promises runs to the end
    ids = engine.tokenizer("The earth was without form").input_ids
    n = 64 - len(ids)
    (seq,) = engine.generate_batch([ids], SamplingParams(max_tokens=n, ignore_eos=True))
    assert len(seq.output_ids) == n and seq.finish_reason == "length"
    assert batcher.counters.aborted == 0


def test_the_calculator_and_the_engine_agree_and_n_sequences_run_unpreempted(bundled_pack):
    pack = Pack(bundled_pack)
    seqs, tokens = 3, 48
    cfg = BatchConfig(max_seqs=seqs, max_batch_tokens=32, max_model_len=tokens)
    calc = BudgetCalculator(pack, "cpu")
    budget = calc.budget("uniform:4", cfg, seqs, tokens)
    engine = Engine(pack)
    batcher = engine.start_batching(parse_policy("uniform:4"), budget, cfg)
    assert batcher.memory.fixed == calc.fixed_bytes("uniform:4", cfg)
    assert batcher.memory.planes == calc.plane_bytes("uniform:4")
    assert batcher.kv.block_bytes == calc.block_bytes("uniform:4", cfg)
    per_seq = batcher.kv.blocks_for(tokens)
    assert batcher.kv.pool.capacity >= seqs * per_seq
    text = "In the beginning God created the heaven and the earth. " * 4
    ids = engine.tokenizer(text).input_ids[: tokens - 16]
    out = engine.generate_batch([ids] * seqs, SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(len(s.output_ids) == 16 for s in out)
    assert batcher.scheduler.preemptions == 0


def test_the_largest_step_runs_over_one_sequences_blocks_and_gives_them_back(bundled_pack):
    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_seqs=3, max_batch_tokens=16, max_model_len=48)
    batcher = engine.start_batching(parse_policy("uniform:4"), None, cfg)
    kv, runner = batcher.kv, batcher.runner
    runner.graphs = DecodeGraphs(engine.model, kv, cfg.max_seqs, capture=False)
    free, tables, give_back = kv.available, {}, kv.free
    kv.free = lambda seq: tables.setdefault(seq, list(kv.tables[seq])) and give_back(seq)
    assert not kv.k[0].any()  # nothing has run
    with runner.probe_sequence(48) as rows:  # the engine's two start-up runs, as it makes them
        runner.largest_eager_step(rows, cfg.max_seqs, cfg.max_batch_tokens, 48)
        runner.largest_graph_step(48)
    assert kv.available == free and kv.used == 0
    (table,) = tables.values()
    last = kv.block_rows(torch.tensor(table), torch.tensor([47]))  # every row wrote there
    assert kv.k[0][last].any() and kv.v[-1][last].any()
    too_long = pytest.raises(RuntimeError, match="no room in the KV cache for 4800 tokens")
    with too_long, batcher.runner.probe_sequence(4800):
        pass


def test_a_step_larger_than_the_formula_shrinks_the_arena(bundled_pack, monkeypatch):
    """Where the device measures steps (CUDA), start-up runs the largest step once; if it took
    more than the formula's workspace, the KV cache gives up those bytes and the fixed part
    keeps the measured figure (the next start-up of the same shape measures nothing)."""
    import pwctl.runtime.engine.engine as engine_module

    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_seqs=8, max_batch_tokens=16, max_model_len=48)  # 3 blocks a sequence
    engine.set_policy(parse_policy("uniform:4"))
    formula = engine.fixed_part(cfg)
    budget = formula.total + engine.plane_bytes() + 30 * engine._block_bytes(cfg)
    before = engine.start_batching(parse_policy("uniform:4"), budget, cfg).kv.pool.capacity
    assert before == 24  # 8 sequences' blocks: the most it would ever use
    extra = 20 * engine._block_bytes(cfg)
    runs = []

    def measured(device, eager, graphs):
        eager()
        graphs()
        runs.append((device, eager.func.__self__.kv.pool.capacity))
        return formula.parts["step"] + extra

    monkeypatch.setattr(engine_module, "measures_steps", lambda device: True)
    monkeypatch.setattr(engine_module, "step_bytes", measured)
    batcher = engine.start_batching(parse_policy("uniform:4"), budget, cfg)
    assert runs == [("cpu", 3)]  # in a probe arena of one sequence: the step's room is the rest's
    assert batcher.memory.fixed == formula.total + extra
    assert engine.fixed_part(cfg).measured == formula.parts["step"] + extra
    assert batcher.kv.pool.capacity == 30 - 20
    assert batcher.memory.total == budget and batcher.kv.used == 0
    engine.start_batching(parse_policy("uniform:4"), budget, cfg)
    assert len(runs) == 1  # measured once a shape


def test_the_calculator_measures_as_the_engine_does(bundled_pack, monkeypatch):
    """`serving_budget --measure`: the fixed part is the engine's own after its start-up step,
    so a budget for N sequences holds N where the formula fell short."""
    import pwctl.runtime.engine.engine as engine_module

    pack = Pack(bundled_pack)
    cfg = BatchConfig(max_seqs=3, max_batch_tokens=32, max_model_len=48)
    formula = BudgetCalculator(pack, "cpu")
    assert BudgetCalculator(pack, "cpu", measure=True).fixed_bytes("uniform:4", cfg) == (
        formula.fixed_bytes("uniform:4", cfg)
    )  # nothing measured on the CPU: the formula stands
    extra = 7 * formula.block_bytes("uniform:4", cfg)
    step = Engine(pack).fixed_part(cfg).parts["step"]
    monkeypatch.setattr(engine_module, "measures_steps", lambda device: True)
    monkeypatch.setattr(
        engine_module,
        "step_bytes",
        lambda device, eager, graphs: eager() or graphs() or step + extra,
    )
    measured = BudgetCalculator(pack, "cpu", measure=True)
    assert measured.fixed_bytes("uniform:4", cfg) == formula.fixed_bytes("uniform:4", cfg) + extra
    engine = Engine(pack)
    batcher = engine.start_batching(
        parse_policy("uniform:4"), measured.budget("uniform:4", cfg, 3, 48), cfg
    )
    assert batcher.kv.pool.capacity >= 3 * batcher.kv.blocks_for(48)


def test_the_largest_step_finds_room_under_a_dynamic_policys_first_plan(bundled_pack, monkeypatch):
    """pagedweight's first plan may leave the KV cache less than one sequence at start-up: the
    step demotes planes for its sequence (as a request would), then the arena is planned
    afresh, and serving starts with no move counted."""
    import pwctl.runtime.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "measures_steps", lambda device: True)
    monkeypatch.setattr(
        engine_module, "step_bytes", lambda device, eager, graphs: eager() or graphs() or 0
    )
    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_seqs=4, max_batch_tokens=32, block_size=4, max_model_len=64)
    policy = parse_policy("pagedweight:0.6")
    batcher = engine.start_batching(policy, engine.smallest_budget(policy, cfg) + 4096, cfg)
    assert batcher.kv.used == 0 and batcher.memory.moves.demotions == 0
    ids = engine.tokenizer("In the beginning").input_ids
    (seq,) = engine.generate_batch([ids], SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(seq.output_ids) == 40


def test_budget_gives_way_rather_than_refusing_or_cutting_short(bundled_pack):
    """pagedweight at a BUDGET above what the memory budget leaves planes: it starts (the
    narrowest widths fit), and under KV pressure its planes go below BUDGET (floors relaxed)
    instead of preempting or aborting; once the KV cache drains the floors come back."""
    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_seqs=4, max_batch_tokens=32, block_size=4, max_model_len=64)
    policy = parse_policy("pagedweight:0.6")  # every block near its widest
    need = engine.smallest_budget(policy, cfg)
    batcher = engine.start_batching(policy, need + 6 * 1024, cfg)
    allocator = engine.allocator
    assert batcher.memory.planes < allocator.budget  # BUDGET gave way at start
    text = ["In the beginning", "The quick brown fox", "It is a truth", "0123 4567"]
    ids = [engine.tokenizer(t).input_ids for t in text]
    out = engine.generate_batch(ids, SamplingParams(max_tokens=40, ignore_eos=True))
    assert all(len(s.output_ids) == 40 and s.finish_reason == "length" for s in out)
    assert batcher.counters.aborted == 0
    assert batcher.memory.moves.demotions > 0
    assert batcher.memory.planes >= allocator.narrowest


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    policy=st.sampled_from(["pagedweight:0.3", "pagedweight:0.5", "uniform:3"]),
    slack_blocks=st.integers(0, 24),
)
def test_no_request_is_cut_short_under_tight_budgets(bundled_pack, data, policy, slack_blocks):
    """Random arrivals and lengths under a budget near the smallest that starts: every request
    gets all its tokens (preemption by recompute is allowed, aborts are not)."""
    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_seqs=4, max_batch_tokens=24, block_size=4, max_model_len=48)
    p = parse_policy(policy)
    need = engine.smallest_budget(p, cfg)
    batcher = engine.start_batching(p, need + slack_blocks * batcher_block(engine, cfg), cfg)
    n = data.draw(st.integers(2, 6))
    lengths = data.draw(st.lists(st.integers(2, 16), min_size=n, max_size=n))
    outs = data.draw(st.lists(st.integers(1, 24), min_size=n, max_size=n))
    arrive = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    base = engine.tokenizer("In the beginning God created the heaven and the earth " * 3)
    seqs, step = [], 0
    while len(seqs) < n or batcher.has_work:
        while len(seqs) < n and arrive[len(seqs)] <= step:  # in order of their index
            i = len(seqs)
            params = SamplingParams(max_tokens=outs[i], ignore_eos=True)
            seqs.append(batcher.add(base.input_ids[: lengths[i]], params))
        batcher.step() if batcher.has_work else batcher.idle()
        step += 1
        assert step < 2000
    assert [len(s.output_ids) for s in seqs] == outs
    assert batcher.counters.aborted == 0


def batcher_block(engine: Engine, cfg: BatchConfig) -> int:
    from pwctl.runtime.memory.kv_cache import KVCache, KVLayout

    layout = KVLayout.from_config(engine.model.config, engine.dtype)
    return KVCache.block_bytes_of(layout, cfg.block_size)


def test_auto_policy_is_pagedweight_with_a_profile_and_uniform_without(bundled_pack, packs):
    from pwctl.policy import auto_max_bits

    pack = Pack(bundled_pack)
    m = pack.manifest
    engine = Engine(pack, max_bits=auto_max_bits(None, m.min_bits, m.max_bits))
    assert engine.store.max_bits == 4  # the bundled pack holds 3..6: auto serves up to 4
    cfg = BatchConfig(max_seqs=2, max_batch_tokens=16, max_model_len=64)
    roomy = engine.auto_policy(None, cfg)
    assert roomy.name == "pagedweight" and roomy.budget.nbytes == engine.widest_plane_bytes()
    # a budget that holds less than every block at 4 bits: BUDGET is what it leaves, and it starts
    tight = engine.smallest_budget(parse_policy("pagedweight:0.3"), cfg) + 64 * 1024
    chosen = engine.auto_policy(tight, cfg)
    assert chosen.name == "pagedweight"
    assert engine.narrowest_plane_bytes() <= chosen.budget.nbytes < engine.widest_plane_bytes()
    batcher = engine.start_batching(chosen, tight, cfg)
    assert batcher.info["policy"] == str(chosen) and batcher.info["device"] == "cpu"
    # no profile: uniform at the widest width that fits
    plain = Engine(Pack(packs[("mixtral", "per_expert")]), max_bits=4)
    assert plain.auto_policy(None, cfg) == parse_policy("uniform:4")


def test_generate_defaults_to_auto_on_the_cpu(bundled_pack):
    from typer.testing import CliRunner

    from pwctl.cli import app

    r = CliRunner().invoke(
        app, ["generate", str(bundled_pack), "--prompt", "The earth", "--max-tokens", "3"]
    )
    assert r.exit_code == 0, r.output
    assert "policy pagedweight:" in r.output and "device cpu" in r.output


def test_a_budget_past_what_the_machine_has_is_refused(bundled_pack):
    engine = Engine(Pack(bundled_pack))
    with pytest.raises(PwctlError, match="more than the machine has"):
        engine.start_batching(parse_policy("uniform:4"), "99999999TB", BatchConfig(max_seqs=1))


def test_reserved_where_groups_segments_by_stream_and_pool(monkeypatch):
    """The peak timeline's breakdown sums each (stream, pool)'s segments; another device's
    segments are left out."""
    mib = 1 << 20
    segments = [
        {"device": 0, "stream": 0, "segment_pool_id": (0, 0), "total_size": 20 * mib,
         "allocated_size": 12 * mib},
        {"device": 0, "stream": 0, "segment_pool_id": (0, 0), "total_size": 2 * mib,
         "allocated_size": 2 * mib},
        {"device": 0, "stream": 0, "segment_pool_id": (1, 0), "total_size": 40 * mib,
         "allocated_size": 0},
        {"device": 1, "stream": 0, "segment_pool_id": (0, 0), "total_size": 99 * mib,
         "allocated_size": 0},
    ]  # fmt: skip
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    rows = accounting.reserved_where("cuda:0")
    assert rows == [
        {"stream": 0, "pool": "default", "reserved_mb": round(22 * mib / 1e6, 1),
         "allocated_mb": round(14 * mib / 1e6, 1), "segments": 2},
        {"stream": 0, "pool": "graph (1, 0)", "reserved_mb": round(40 * mib / 1e6, 1),
         "allocated_mb": 0.0, "segments": 1},
    ]  # fmt: skip


def test_probe_ids_are_the_same_in_every_process():
    """A measured step's token ids come from a fixed seed: two draws agree, and they cover
    more than one id (they still spread over experts)."""
    a, b = accounting.probe_ids(1000, (1, 64)), accounting.probe_ids(1000, (1, 64))
    assert torch.equal(a, b)
    assert a.unique().numel() > 32


def test_the_allocator_cap_names_its_device_by_index(monkeypatch):
    """torch's fraction setter takes no index-less device ("cuda" alone raised ValueError at every
    engine start on an H100): the cap and its release pass an index, on CPU with CUDA faked."""
    from torch.cuda import _utils

    total, fractions = 80 << 30, []

    def set_fraction(fraction: float, device: object) -> None:
        _utils._get_device_index(device)  # the check torch's own setter makes first
        fractions.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(accounting, "_cupy_pool_bytes", lambda: 0)
    cap = accounting.cap_allocator("cuda", 10 << 30)
    accounting.cap_allocator("cuda:1", 10 << 30)
    accounting.release_allocator_cap("cuda")
    assert cap == int((10 << 30) * (1 + accounting.SLACK))
    assert fractions == [(cap / total, 0), (cap / total, 1), (1.0, 0)]
