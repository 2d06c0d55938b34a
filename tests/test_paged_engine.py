"""The paged experts backend (page table + pager + device table + fused MoE) in the engine gives
what the ExpertStore backend gives: same logits, same greedy tokens, same batched outputs, also
while the memory budget demotes and promotes planes through the pager mid-generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pwctl.build import tiny
from pwctl.build.profile import run_profile
from pwctl.errors import PwctlError
from pwctl.format.pack import Pack
from pwctl.policy import Policy, parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.engine import Engine, experts_for
from pwctl.runtime.engine.scheduler import SamplingParams
from pwctl.runtime.memory.paged_experts import PagedExperts
from pwctl.runtime.moe.block import MoETap

PROMPTS = [
    "In the beginning God created",
    "The quick brown fox",
    "It is a truth universally acknowledged that a single man",
    "0123",
]


def engines(path, device: str = "cpu") -> tuple[Engine, Engine]:
    pack = Pack(path)
    return Engine(pack, device, experts="store"), Engine(pack, device, experts="paged")


def same_logits_and_tokens(store: Engine, paged: Engine, policy: str, n_tokens: int = 8) -> None:
    store.set_policy(parse_policy(policy))
    paged.set_policy(parse_policy(policy))
    assert np.array_equal(paged.paged.widths, store.store.widths)
    ids = torch.tensor([store.tokenizer(PROMPTS[2]).input_ids])
    with MoETap(store.model) as want, MoETap(paged.model) as got:
        ref, out = store.logits(ids), paged.logits(ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for layer, (x, index, weights) in want.seen.items():  # the tap sees the same routing
        gx, gi, gw = got.seen[layer]
        assert torch.equal(gi, index)
        torch.testing.assert_close(gx, x, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gw, weights, rtol=1e-4, atol=1e-4)
    prompt = ids[0].tolist()
    assert paged.generate_ids(prompt, n_tokens) == store.generate_ids(prompt, n_tokens)


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_paged_equals_store_every_arch(arch, packs):
    store, paged = engines(packs[(arch, "per_expert")])
    m = store.pack.manifest
    for policy in (f"uniform:{m.max_bits}", "uniform:3"):
        same_logits_and_tokens(store, paged, policy)


def test_moe_blocks_route_through_the_fused_moe(bundled_qwen_pack, monkeypatch):
    """MoEBlock hands its router to `FusedMoE.routed` (on CUDA one launch routes and prepares the
    decode; here torch's router, the reference), every layer, with the tap on: the tap sees
    routing equal to the store engine's, in buffers of its own."""
    from pwctl.runtime.moe.fused import FusedMoE

    store, paged = engines(bundled_qwen_pack)
    store.set_policy(parse_policy("uniform:4"))
    paged.set_policy(parse_policy("uniform:4"))
    calls, real = [], FusedMoE.routed

    def routed(self, layer, *args):
        out, routing = real(self, layer, *args)
        calls.append((layer, routing.index))
        return out, routing

    monkeypatch.setattr(FusedMoE, "routed", routed)
    ids = torch.tensor([store.tokenizer(PROMPTS[0]).input_ids])
    with MoETap(store.model) as want, MoETap(paged.model) as got:
        torch.testing.assert_close(paged.logits(ids), store.logits(ids), rtol=1e-4, atol=1e-4)
    assert [layer for layer, _ in calls] == sorted(want.seen)
    for layer, index in calls:
        assert torch.equal(got.seen[layer][1], want.seen[layer][1])
        assert got.seen[layer][1].data_ptr() != index.data_ptr()  # a copy: buffers are reused


@pytest.mark.parametrize("fixture", ["bundled_pack", "bundled_qwen_pack"])
def test_paged_equals_store_bundled(fixture, request):
    store, paged = engines(request.getfixturevalue(fixture))
    for policy in ("uniform:6", "uniform:3"):
        same_logits_and_tokens(store, paged, policy, 16)
        cfg = BatchConfig(max_batch_tokens=16)
        ids = [store.tokenizer(p).input_ids for p in PROMPTS]
        outs = []
        for engine in (store, paged):
            engine.start_batching(parse_policy(policy), None, cfg)
            outs.append([s.output_ids for s in engine.generate_batch(ids, SamplingParams(16))])
        assert outs[0] == outs[1]
        assert outs[1][0] == paged.generate_ids(ids[0], 16)


def pressure_run(
    engine: Engine, budget: int | None, cfg: BatchConfig, policy_text: str = "pagedweight:0.4"
) -> tuple[list, list]:
    """Eight requests under KV pressure (demotions), the short ones finish, the long one keeps
    decoding while the freed KV memory goes back to the planes (promotions after the planner's
    cooldown). Returns the outputs and the widths of every step."""
    policy = parse_policy(policy_text)
    batcher = engine.start_batching(policy, None if budget is None else f"{budget}b", cfg)
    if engine.paged is not None:  # each boundary: the widths kernels read are the plan's
        commit = batcher.boundary

        def checked() -> int:
            moved = commit()
            assert np.array_equal(engine.paged.widths, engine.store.widths)
            engine.paged.pager.check()
            return moved

        batcher.boundary = checked
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS * 2]
    seqs = [
        engine.add_request(i, SamplingParams(max_tokens=56 if n == 0 else 12, ignore_eos=True))
        for n, i in enumerate(ids)
    ]
    trace = []
    while batcher.has_work:
        engine.step()
        trace.append(engine.store.widths.copy())
    return [s.output_ids for s in seqs], trace


def test_paged_pressure_demotes_and_promotes_through_pager(bundled_pack):
    store, paged = engines(bundled_pack)
    cfg = BatchConfig(max_seqs=8, max_batch_tokens=64, block_size=4, max_model_len=96)
    probe = store.start_batching(parse_policy("pagedweight:0.4"), None, cfg)
    budget = probe.memory.fixed + store.widest_plane_bytes() + 12 * probe.kv.block_bytes
    want, want_trace = pressure_run(store, budget, cfg)
    got, got_trace = pressure_run(paged, budget, cfg)
    assert got == want
    assert all(np.array_equal(a, b) for a, b in zip(got_trace, want_trace, strict=True))
    moves = paged.batcher.memory.moves
    assert moves.demotions > 0 and moves.promotions > 0
    assert paged.batcher.counters.copied_bytes > 0  # promotions copied planes mid-generation
    assert paged.batcher.metrics()["plane_copied_bytes"] == paged.batcher.counters.copied_bytes
    widths = np.stack(got_trace)
    first_low = np.flatnonzero((widths < widths[0]).any(1))
    assert first_low.size and (widths[first_low[0] :] > widths[first_low[0]]).any()


def arena_run(engine: Engine, deferred: bool = False) -> None:
    """Eight requests under KV pressure on a paged engine, then idle steps: checks at every
    step boundary that one arena, never reallocated, holds planes and KV blocks (planes + KV
    + free slabs = the arena, pager invariants, the budget's slab accounting), that demoted
    planes' slabs become KV blocks and, once the load drained, KV blocks' slabs planes. On
    the CPU backend copies land at submit, so the widths kernels read are the plan's at every
    boundary (test_paged_pressure_... compares the outputs with the store engine's), unless
    `deferred`: then copies land only when the test says, as on a GPU."""
    cuda = engine.device.startswith("cuda")
    synchronous = not cuda and not deferred
    cfg = BatchConfig(max_seqs=8, max_batch_tokens=64, block_size=4, max_model_len=96)
    probe = engine.start_batching(parse_policy("pagedweight:0.4"), None, cfg)
    budget = probe.memory.fixed + engine.widest_plane_bytes() + 12 * probe.kv.block_bytes
    batcher = engine.start_batching(parse_policy("pagedweight:0.4"), f"{budget}b", cfg)
    paged, kv, memory = engine.paged, batcher.kv, batcher.memory
    pager, arena = paged.pager, paged.dt.arena
    n_slabs = paged.table.n_slabs
    if not cuda:
        paged.backend.deferred = deferred
    assert n_slabs * paged.slab_bytes == budget - memory.fixed  # the whole budget but fixed
    assert kv.k is None and kv.block_bytes % paged.slab_bytes == 0  # no KV tensors of its own
    assert memory.planes + 12 * kv.block_bytes == memory.space  # widest planes + 12 blocks
    snaps: list[tuple[set, set]] = []
    flying: list[int] = []  # blocks promoting at each boundary
    commit = batcher.boundary

    def checked() -> int:
        moved = commit()
        assert paged.pager is pager and paged.dt.arena is arena  # never reallocated
        assert arena.shape == (n_slabs, paged.slab_bytes) and paged.table.n_slabs == n_slabs
        pager.check()  # page-table invariants, and planes + lent + free = the pool
        c = pager.counts()
        t = paged.table
        planes = set(t.slab_map[t.slab_map >= 0].tolist())
        kv_ids = set(kv.slab_ids().tolist())
        assert kv_ids == set(np.flatnonzero(pager.lent).tolist())
        assert len(kv_ids) == kv.used * kv.slabs_per_block
        assert c["planes"] + c["lent"] + c["free"] == n_slabs
        assert c["planes"] >= len(planes) and c["lent"] >= len(kv_ids)
        # the accounting: slabs of the plan (whole slabs) + KV limit never exceed the arena
        assert memory.planes == paged.plane_cost(engine.store.widths)
        assert memory.planes + kv.pool.limit * kv.block_bytes <= memory.space
        assert not synchronous or np.array_equal(paged.widths, engine.store.widths)
        snaps.append((planes, kv_ids))
        flying.append(int((t.target > 0).sum()))
        return moved

    batcher.boundary = checked
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS * 2]
    for n, i in enumerate(ids):
        engine.add_request(i, SamplingParams(max_tokens=40 if n == 0 else 12, ignore_eos=True))
    while batcher.has_work:
        engine.step()
        if deferred and len(snaps) % 3 == 0:
            paged.backend.complete()  # copies land every third step
    assert memory.moves.demotions > 0 and kv.used == 0
    drained, promoted = len(snaps), memory.moves.promotions
    for _ in range(80):  # the load drained: planes come back as the cooldown allows
        batcher.idle()
        if cuda:
            torch.cuda.synchronize()  # copies land: the next boundary confirms them
        elif deferred:
            paged.backend.complete()
    assert memory.moves.promotions > promoted
    # slabs planes held at one boundary and KV blocks at the next (demotions made room) ...
    to_kv = [i for i in range(1, drained) if snaps[i - 1][0] & snaps[i][1]]
    # ... and, after the load, planes again in slabs KV blocks held (promotions took them)
    was_kv = set().union(*(kv_ids for _, kv_ids in snaps[:drained]))
    to_planes = [i for i in range(drained, len(snaps)) if (snaps[i][0] - snaps[i - 1][0]) & was_kv]
    assert to_kv and to_planes
    assert not deferred or max(flying) > 0  # some boundaries ran while promotions copied
    paged.settle()  # CUDA: the last promotions' copies are confirmed
    c = pager.counts()
    assert c["lent"] == 0 and c["planes"] + c["free"] == n_slabs
    assert np.array_equal(paged.widths, engine.store.widths)
    assert batcher.metrics()["arena_slabs"] == c


@pytest.mark.parametrize("deferred", [False, True])
def test_planes_and_kv_blocks_share_one_arena(bundled_pack, deferred):
    arena_run(Engine(Pack(bundled_pack), experts="paged"), deferred)


def test_paged_refuses_what_planes_cannot_hold(bundled_pack):
    paged = Engine(Pack(bundled_pack), experts="paged")
    with pytest.raises(PwctlError, match="not expressible in bit planes"):
        paged.set_policy(parse_policy("fp16"))
    paged.store.add_variant("rtn-g128:3", {}, 0)
    with pytest.raises(PwctlError, match="not expressible in bit planes"):
        paged.set_policy(Policy("rtn-g128:3"))
    with pytest.raises(PwctlError, match="store experts"):
        run_profile(paged, torch.zeros(1, 4, dtype=torch.long), "proxy")
    with pytest.raises(PwctlError, match="experts 'gpu'"):
        Engine(Pack(bundled_pack), experts="gpu")
    assert Engine(Pack(bundled_pack)).experts == "store"  # the CPU default
    assert experts_for(parse_policy("uniform:3"), "cuda") == "paged"
    assert experts_for(parse_policy("fp16"), "cuda") == "dense"  # the 16-bit grouped GEMMs
    assert experts_for(Policy("x"), "cpu") == "store"


def test_paged_experts_fit_a_small_pool(packs):
    pack = Pack(packs[("qwen2_moe", "per_expert")])
    m = pack.manifest
    full = PagedExperts(pack)
    assert np.all(full.widths == 0)  # nothing resident before the first request
    full.request(np.full(full.table.n_blocks, m.max_bits))
    full.settle()
    widest = full.table.cost_at[:, m.max_bits].sum()
    assert full.device_bytes() == widest == full.table.device_bytes()
    assert np.all(full.widths == m.max_bits)
    small = PagedExperts(pack, budget_bytes=int(0.6 * widest))
    small.request(np.full(small.table.n_blocks, m.max_bits))
    small.settle()
    t = small.table
    assert t.cost_at[np.arange(t.n_blocks), small.widths].sum() <= t.n_slabs * t.slab_bytes
    assert small.widths.min() >= m.min_bits and small.widths.max() < m.max_bits
    small.pager.check()
    assert small.commit() == 0  # settled: nothing moves
    small.request(np.full(t.n_blocks, m.min_bits))
    assert small.commit() == 0 and np.all(small.widths == m.min_bits)  # demotion: no copy
    small.request(np.full(t.n_blocks, m.min_bits + 1))
    assert small.commit() > 0 and np.all(small.widths == m.min_bits + 1)  # CPU: confirmed now
    with pytest.raises(ValueError, match="minimum width"):
        PagedExperts(pack, budget_bytes=int(t.cost_at[:, m.min_bits].sum()) - 1).request(
            np.full(t.n_blocks, m.min_bits)
        )


# --- CUDA (skipped without a device): the kernels inside the engine ---------------------------


@pytest.mark.gpu
def test_paged_engine_on_cuda_matches_store(bundled_pack):
    """The CUDA kernels (decode <= 8 tokens, prefill above) in the serving engine against the
    store engine on the same GPU: fp16 activations in prefill, so a looser tolerance."""
    store, paged = engines(bundled_pack, "cuda")
    assert paged.experts == "paged" and paged.paged.dt.arena.is_cuda
    ids = [store.tokenizer(p).input_ids for p in PROMPTS]
    for policy in ("uniform:6", "uniform:3"):
        store.set_policy(parse_policy(policy))
        paged.set_policy(parse_policy(policy))
        for prompt in (ids[2] + ids[0], ids[2][:4]):  # prefill path (> 8 tokens), decode
            x = torch.tensor([prompt])
            ref, out = store.logits(x), paged.logits(x)
            err = float((out - ref).norm() / ref.norm())
            assert err < 1e-2, f"{policy}: logits relative error {err:.2e}"
        assert paged.generate_ids(ids[0], 16) == store.generate_ids(ids[0], 16)
        outs = []
        for engine in (store, paged):
            engine.start_batching(parse_policy(policy), None, BatchConfig(max_batch_tokens=16))
            outs.append([s.output_ids for s in engine.generate_batch(ids, SamplingParams(16))])
        assert outs[0] == outs[1]


@pytest.mark.gpu
def test_paged_arena_on_cuda(bundled_pack):
    """The shared arena on the CUDA backend (rebuilt from the budget, KV blocks read and
    written through slabs in device memory, fences as CUDA events), under KV pressure; and
    serving allocates no KV memory outside the arena."""
    engine = Engine(Pack(bundled_pack), "cuda", experts="paged")
    assert engine.paged.dt.arena.is_cuda
    arena_run(engine)
    before = torch.cuda.memory_allocated()
    batcher = engine.batcher
    torch.cuda.reset_peak_memory_stats()
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS * 2]
    batcher.run(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    # activations only: KV blocks live in the arena (fixed: weights + workspace estimate)
    assert torch.cuda.max_memory_allocated() - before <= batcher.memory.fixed


# --- a serving-time width cap (--max-bits) -----------------------------------------------------


def test_max_bits_caps_every_plan_and_the_widest_planes(bundled_pack):
    """`Engine(max_bits=5)` on a 3..6-bit pack: every block starts at 5, no plan of a budgeted
    policy goes past it (with spare memory the uncapped planner does reach 6), the widest
    plane bytes the budget sizes for are those at 5 bits, and wider fixed policies are refused."""
    pack = Pack(bundled_pack)
    free, capped = Engine(pack), Engine(pack, max_bits=5)
    assert (capped.store.widths == 5).all()
    assert capped.widest_plane_bytes() == sum(b.bytes_at(5) for b in pack.blocks)
    assert capped.widest_plane_bytes() < free.widest_plane_bytes()
    policy = parse_policy("pagedweight:0.6")
    cfg = BatchConfig(max_seqs=2, max_batch_tokens=16)
    free.start_batching(policy, None, cfg)
    capped.start_batching(policy, None, cfg)
    assert free.store.widths.max() == 6  # room to spare: the uncapped planner uses width 6
    assert capped.store.widths.max() == 5 and capped.store.widths.min() >= pack.manifest.min_bits
    assert capped.batcher.memory.planes <= capped.widest_plane_bytes()
    with pytest.raises(PwctlError, match=r"serves widths 3\.\.5 \(--max-bits\)"):
        capped.set_policy(parse_policy("uniform:6"))
    capped.set_policy(parse_policy("uniform:4"))
    assert (capped.store.widths == 4).all()
    for bad in (2, 7):
        with pytest.raises(PwctlError, match=rf"--max-bits {bad}: this pack holds widths 3\.\.6"):
            Engine(pack, max_bits=bad)


def test_max_bits_paged_pressure_equals_store(bundled_pack):
    """Under the cap, demotions and promotions through the pager give what the store gives, and
    no step's widths (planned or read by the kernels) pass the cap."""
    pack = Pack(bundled_pack)
    store, paged = Engine(pack, max_bits=5), Engine(pack, experts="paged", max_bits=5)
    assert paged.paged.table.n_slabs * paged.paged.slab_bytes == paged.widest_plane_bytes()
    cfg = BatchConfig(max_seqs=8, max_batch_tokens=64, block_size=4, max_model_len=96)
    probe = store.start_batching(parse_policy("pagedweight:0.25"), None, cfg)
    budget = probe.memory.fixed + store.widest_plane_bytes() + 12 * probe.kv.block_bytes
    want, want_trace = pressure_run(store, budget, cfg, "pagedweight:0.25")
    got, got_trace = pressure_run(paged, budget, cfg, "pagedweight:0.25")
    assert got == want
    assert all(np.array_equal(a, b) for a, b in zip(got_trace, want_trace, strict=True))
    assert np.stack(got_trace).max() == 5 and paged.paged.widths.max() <= 5
    moves = paged.batcher.memory.moves
    assert moves.demotions > 0 and moves.promotions > 0


@pytest.mark.gpu
def test_max_bits_on_cuda(bundled_pack):
    """The cap on the CUDA backend: under KV pressure (demotions, then promotions as the KV
    drains) no plan and no width the kernels read passes it, and every request completes."""
    paged = Engine(Pack(bundled_pack), "cuda", experts="paged", max_bits=5)
    cfg = BatchConfig(max_seqs=8, max_batch_tokens=64, block_size=4, max_model_len=96)
    probe = paged.start_batching(parse_policy("pagedweight:0.25"), None, cfg)
    budget = probe.memory.fixed + paged.widest_plane_bytes() + 12 * probe.kv.block_bytes
    outs, trace = pressure_run(paged, budget, cfg, "pagedweight:0.25")
    assert [len(o) for o in outs] == [56] + [12] * (len(outs) - 1)
    assert np.stack(trace).max() == 5 and paged.paged.widths.max() <= 5
    moves = paged.batcher.memory.moves
    assert moves.demotions > 0 and moves.promotions > 0
