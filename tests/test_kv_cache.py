"""The paged KV cache: block pool bounds, per-sequence tables, slots, freeing."""

import numpy as np
import pytest
import torch

from pwctl.errors import PwctlError
from pwctl.runtime.memory.kv_cache import BlockPool, KVCache, KVLayout

LAYOUT = KVLayout(n_layers=2, kv_heads=2, head_dim=4)


def test_per_layer_layout_counts_each_layers_bytes():
    mixed = KVLayout(2, 2, 16, torch.float16, shapes=((3, 4), (2, 16)), sources=(0, 1, 0, 1))
    assert mixed.bytes_per_token() == 2 * 2 * (3 * 4 + 2 * 16)  # not 2 x 4 layers x the widest
    assert [mixed.source(a) for a in range(4)] == [0, 1, 0, 1]
    assert [mixed.owns(a) for a in range(4)] == [True, True, False, False]
    assert LAYOUT.source(1) == 1 and LAYOUT.owns(1) and LAYOUT.shape(1) == (2, 4)
    # 8-byte units (the 24-byte rows'), 16-token blocks: 2 x 16 x (3 + 8) units of 32 a slab
    assert KVCache.slabs_of(mixed, 16, 256) == -(-(2 * 16 * (3 + 8)) // 32)


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


def test_table_arrays_follow_their_tables_through_grow_and_free():
    kv = KVCache(LAYOUT, capacity=6, block_size=4)
    assert kv.grow(1, 5) and kv.grow(2, 4)
    first = kv.table_array(1)
    assert first.tolist() == kv.tables[1] and kv.table_array(1) is first  # made once
    assert kv.grow(1, 9) and kv.table_array(1).tolist() == kv.tables[1] == [
        *first,
        kv.tables[1][-1],
    ]
    kv.free(1)  # preempted, then back: new blocks (here the same count) in a new table
    assert kv.grow(3, 4) and kv.grow(1, 9)
    assert kv.table_array(1).tolist() == kv.tables[1]
    assert kv.table_array(2).tolist() == kv.tables[2]


class Slabs:
    """A slab pool standing for the paged backend's arena (PagedExperts' lending side)."""

    def __init__(self, n_slabs: int, slab_bytes: int):
        from pwctl.runtime.memory.pager import SlabPool

        self.slab_bytes, self.pool = slab_bytes, SlabPool(n_slabs)
        self.arena = torch.zeros((n_slabs, slab_bytes), dtype=torch.uint8)

    def lend(self, n):
        return self.pool.take(n)

    def give_back(self, ids):
        self.pool.give(np.asarray(ids, dtype=np.int32))

    def drain(self):
        pass


@pytest.mark.parametrize(
    "layout",
    [
        LAYOUT,  # rows of 32 bytes: 8 per slab
        KVLayout(n_layers=3, kv_heads=2, head_dim=64),  # 512-byte rows over two slabs
        KVLayout(n_layers=2, kv_heads=3, head_dim=4, dtype=torch.float16),  # 24-byte rows
        # layers of their own shapes (Gemma-4: full layers' wider heads), 3 attention layers
        # over 2 cache layers (the last shares the first's keys and values)
        KVLayout(2, 2, 16, torch.float16, shapes=((3, 4), (2, 16)), sources=(0, 1, 0)),
    ],
)
def test_arena_blocks_hold_what_own_tensors_hold(layout):
    k = KVCache.slabs_of(layout, 4, 256)
    slabs = Slabs(4 * k, 256)
    own, arena = KVCache(layout, 6, block_size=4), KVCache(layout, 6, 4, slabs=slabs)
    assert arena.block_bytes == k * 256 >= own.block_bytes and arena.slabs_per_block == k
    g = torch.Generator().manual_seed(0)
    lengths = {1: 7, 2: 3}
    for kv in (own, arena):
        for seq, n in lengths.items():
            assert kv.grow(seq, n)
    held = arena.slab_ids()
    assert held.size == len(np.unique(held)) == 3 * k and slabs.pool.top == k
    for layer in range(layout.n_layers):
        for seq, n in lengths.items():
            shape = (n, *layout.shape(layer))
            key = torch.randn(shape, generator=g).to(layout.dtype)
            value = torch.randn(shape, generator=g).to(layout.dtype)
            for kv in (own, arena):
                kv.write(layer, kv.slots(seq, 0, n), key, value)
    for layer in range(layout.n_layers):
        for seq, n in lengths.items():
            want = own.read(layer, own.slots(seq, 0, n))
            got = arena.read(layer, arena.slots(seq, 0, n))
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert arena.free(1) == 2 and slabs.pool.top == 3 * k
    short = KVCache(layout, 6, 4, slabs=Slabs(k, 256))  # one block's slabs in the arena
    assert short.grow(1, 4) and not short.grow(2, 1) and short.used == 1  # nothing taken
    assert short.free(1) == 1 and short.grow(2, 1)


@pytest.mark.parametrize("window", [None, 3])
def test_batched_decode_attention_equals_one_span_at_a_time(window):
    """Decode spans attended together (padded, masked; packed rows or the fixed-shape
    `DecodeBatch` a CUDA graph reads) give what one SDPA per span gives. Unwritten cache rows
    hold NaN (as a slab that held planes may): padding must not read them."""
    from types import SimpleNamespace

    from pwctl.runtime.engine.attention import DecodeBatch, PagedBatch, SeqSpan, paged_attention
    from pwctl.runtime.engine.decode_graphs import cache_rows

    layout = KVLayout(n_layers=1, kv_heads=2, head_dim=8)
    kv = KVCache(layout, capacity=13, block_size=4)
    kv.k[0].fill_(float("nan"))
    kv.v[0].fill_(float("nan"))
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 3]  # cached tokens per sequence, the last one being this step's
    spans, slots, blocks = [], [], []
    for i, n in enumerate(lengths):
        rows = torch.arange(n) + 12 * i + 4  # three 4-token blocks per sequence; block 0 unused
        kv.write(0, rows[:-1], *(torch.randn(n - 1, 2, 8, generator=gen) for _ in range(2)))
        spans.append(SeqSpan(i, i + 1, n - 1, rows))
        slots.append(rows[-1:])
        blocks.append(torch.arange(3) + 3 * i + 1)
    T = len(lengths)
    q = torch.randn(1, 4, T, 8, generator=gen)
    k, v = torch.randn(1, 2, T, 8, generator=gen), torch.randn(1, 2, T, 8, generator=gen)
    module = SimpleNamespace(layer_idx=0)

    def attend(batch):
        out, _ = paged_attention(
            module, q, k, v, None, 0.3, sliding_window=window, pwctl_batch=batch
        )
        return out

    one_by_one = PagedBatch(kv, torch.cat(slots), spans)
    one_by_one._decode[window] = None  # force the per-span path
    want = attend(one_by_one)
    batched = PagedBatch(kv, torch.cat(slots), spans)
    got = attend(batched)
    assert batched.decode_group(window) is not None  # the batched path ran
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    n = torch.tensor(lengths)
    table, _ = cache_rows(kv, torch.stack(blocks), n)
    fixed = DecodeBatch(kv, torch.cat(slots), table, n)
    torch.testing.assert_close(attend(fixed), want, rtol=1e-5, atol=1e-6)
    assert not want.isnan().any()
