"""Page table: geometry from plane sizes (and from a real pack), slab accounting, and `check`
catching each broken invariant."""

from __future__ import annotations

import numpy as np
import pytest

from pwctl.format.pack import Pack
from pwctl.runtime.memory.page_table import GPU, IN_FLIGHT, PageTable, choose_slab


def small_table(budget: int = 10_000) -> PageTable:
    pb = np.array([[300, 300, 700, 1500], [100, 100, 300, 600]])
    return PageTable(pb, min_bits=2, budget_bytes=budget, slab_bytes=256)


def test_geometry():
    t = small_table()
    assert t.n_blocks == 2 and t.max_bits == 4 and t.n_slabs == 10_000 // 256
    assert t.plane_slabs.tolist() == [[2, 2, 3, 6], [1, 1, 2, 3]]
    assert t.bytes_at[0].tolist() == [0, 300, 600, 1300, 2800]
    assert t.cost_at[1].tolist() == [0, 256, 512, 1024, 1792]
    # planes lo..hi of a block are one contiguous run of the slab map and of the host layout
    assert t.slabs(0, 1, 3).size == 5 and t.host_range(0, 1, 3) == (512, 512 + 5 * 256)
    assert t.host_range(1, 0, 4) == ((2 + 2 + 3 + 6) * 256, (13 + 7) * 256)
    assert t.host_bytes == 20 * 256
    assert t.leading_gpu().tolist() == [0, 0]
    t.check()


def test_choose_slab():
    assert choose_slab(np.array([100, 200])) == 256  # never below the pack's alignment
    assert choose_slab(np.full(10, 200_000)) == 8192  # <= median / 16: under 3% waste
    assert choose_slab(np.full(10, 200_000), min_bytes=10_000) == 16384  # <= 1 slab edge


def test_from_pack(packs):
    pack = Pack(packs[("qwen2_moe", "per_expert")])
    t = PageTable.from_pack(pack, budget_bytes=1 << 20)
    assert t.n_blocks == len(pack.blocks) and t.max_bits == pack.manifest.max_bits
    for b, block in enumerate(pack.blocks):
        for w in range(t.max_bits + 1):
            assert t.bytes_at[b, w] == block.bytes_at(w)
            assert t.bytes_at[b, w] <= t.cost_at[b, w] < t.bytes_at[b, w] + w * t.slab_bytes + 1
    assert t.shared.sum() == 3 * len(pack.manifest.moe_layers)  # the shared expert's blocks
    assert (t.expert[t.shared] == pack.manifest.spec["num_experts"]).all()


def resident(t: PageTable, b: int, width: int, next_id: list[int]) -> None:
    """Hand-place block b at `width` (what the pager does), for the negative tests."""
    ids = t.slabs(b, 0, width)
    ids[:] = np.arange(next_id[0], next_id[0] + ids.size)
    next_id[0] += ids.size
    t.state[b, :width] = GPU
    t.width[b] = t.wanted[b] = width


def test_check_catches_broken_invariants():
    t = small_table()
    resident(t, 0, 3, nid := [0])
    resident(t, 1, 2, nid)
    free = np.arange(nid[0], t.n_slabs, dtype=np.int32)
    t.check(free)
    cases = []

    def broken(fn, msg):
        cases.append((fn, msg))

    broken(lambda t: t.width.__setitem__(0, 4), "above resident")
    broken(lambda t: t.width.__setitem__(1, 1), "outside")
    broken(lambda t: t.state.__setitem__((0, 1), IN_FLIGHT), "above resident")
    broken(lambda t: t.retire_at.__setitem__((0, 0), 5), "in use is retiring")
    broken(lambda t: t.slab_map.__setitem__(0, 1), "owned twice")
    broken(lambda t: t.state.__setitem__((1, 3), GPU), "GPU\\* IN_FLIGHT\\* HOST\\*")
    for fn, msg in cases:
        u = small_table()
        resident(u, 0, 3, nid := [0])
        resident(u, 1, 2, nid)
        fn(u)
        with pytest.raises(AssertionError, match=msg):
            u.check(np.arange(nid[0], u.n_slabs, dtype=np.int32))
    # a slab both in use and free, and a leaked slab
    with pytest.raises(AssertionError, match="free list"):
        t.check(np.concatenate([free[1:], [0]]).astype(np.int32))
    with pytest.raises(AssertionError, match="leaked"):
        t.check(free[1:])
    # more slabs held than the budget allows
    tiny = small_table(budget=4 * 256)
    with pytest.raises(AssertionError, match="budget"):
        resident(tiny, 0, 3, [0])
        tiny.check()
