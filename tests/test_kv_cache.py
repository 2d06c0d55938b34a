"""The paged KV cache: block pool bounds, per-sequence tables, slots, freeing."""

import pytest
import torch

from pwctl.errors import PwctlError
from pwctl.runtime.kv_cache import BlockPool, KVCache, KVLayout

LAYOUT = KVLayout(n_layers=2, kv_heads=2, head_dim=4)


def test_layout_bytes_and_budget_sizing():
    assert LAYOUT.bytes_per_token() == 2 * 2 * 2 * 4 * 4
    kv = KVCache.from_budget(LAYOUT, 10 * 4 * LAYOUT.bytes_per_token() + 5, block_size=4)
    assert kv.pool.capacity == 10 and kv.block_bytes == 4 * LAYOUT.bytes_per_token()
    assert kv.k[0].shape == (40, 2, 4)
    with pytest.raises(PwctlError, match="at least one block"):
        KVCache.from_budget(LAYOUT, 10, block_size=4)


def test_pool_take_give_back_and_limit():
    pool = BlockPool(4)
    a = pool.take(3)
    assert len(set(a)) == 3 and pool.used == 3 and pool.available == 1
    assert pool.take(2) is None and pool.used == 3  # all or nothing
    pool.set_limit(3)
    assert pool.available == 0 and pool.take(1) is None
    pool.give_back(a[:2])
    assert pool.used == 1 and pool.available == 2
    pool.set_limit(99)
    assert pool.limit == 4 and pool.available == 3


def test_tables_slots_and_free():
    kv = KVCache(LAYOUT, capacity=5, block_size=4)
    assert kv.grow(7, 5) and len(kv.tables[7]) == 2
    assert kv.grow(7, 8) and len(kv.tables[7]) == 2  # still fits in two blocks
    assert kv.need(7, 9) == 1
    assert kv.grow(8, 12) and kv.used == 5 and kv.available == 0
    assert not kv.grow(7, 9) and len(kv.tables[7]) == 2
    t = kv.tables[7]
    slots = kv.slots(7, 2, 7)
    expect = [t[0] * 4 + 2, t[0] * 4 + 3, t[1] * 4, t[1] * 4 + 1, t[1] * 4 + 2]
    assert slots.tolist() == expect
    kv.k[0][slots] = torch.ones(5, 2, 4)
    assert kv.k[0][kv.slots(7, 2, 7)].sum() == 40
    assert kv.free(8) == 3 and kv.free(8) == 0 and kv.available == 3
    assert kv.grow(7, 9) and kv.free(7) == 3 and kv.used == 0
