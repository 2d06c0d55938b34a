"""Paged KV cache: one pool of fixed-size token blocks shared by every sequence, a block table
per sequence, blocks back to the pool when a sequence finishes, is aborted or preempted.

Block ids run 0..capacity-1, `capacity` being the most blocks the memory budget could ever give
the KV cache; `limit` is how many of them may be in use now (the memory budget moves it as the
planner frees or takes back plane bytes). Token `t` of a sequence sits at slot
`table[t // block_size] * block_size + t % block_size`; `write` / `read` move the keys and
values of one layer at given rows (`locate` finds a step's rows for every layer at once).
Two storages:

- own tensors (the store backend): `k[l]`, `v[l]` of shape [capacity * block_size, kv_heads,
  head_dim], allocated once;
- slabs of the paged backend's arena (`slabs`: the PagedExperts), shared with the expert planes:
  a block is `block_slabs` whole slabs taken from the pager's pool when a sequence grows into it
  and given back when it is freed. Inside a block, the rows of (layer, kv) (kv 0: keys, 1:
  values) follow those of every (layer, kv) before them, `block_size` rows each (row s: the
  token's place in the block), a row `row_bytes_of(layer)` long; byte `o` of the block's bytes
  is in slab `block_slabs[block, o // slab]` at offset `o % slab`. Rows are moved in units of
  the largest power of two dividing every layer's row bytes (at most a slab), so a unit never
  crosses a slab edge.

Layers may differ (Gemma-4): each cache layer its own key/value heads and head dim
(`KVLayout.shapes`), and attention layers that share an earlier layer's keys and values read
that layer's rows and store none of their own (`KVLayout.sources`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.runtime.transfer import to_device


@dataclass(frozen=True)
class KVLayout:
    """What one token costs in the cache: K and V of every cache layer. `n_layers` cache layers
    of `kv_heads` x `head_dim` each, or of `shapes[l]` = (kv_heads, head_dim) where given (then
    `kv_heads`, `head_dim` are the widest layer's); `sources[a]`: the cache layer attention
    layer `a` reads (empty: layer a reads cache layer a)."""

    n_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    shapes: tuple[tuple[int, int], ...] = ()
    sources: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype = torch.float32) -> KVLayout:
        """Per layer where the config says so (transformers' `per_layer_config`: Gemma-4's
        full layers; `kv_sharing_modes`: layers reusing an earlier layer's keys and values)."""
        n, heads = config.num_hidden_layers, config.num_attention_heads
        per = getattr(config, "per_layer_config", None)
        shapes = []
        for i in range(n):
            c = config if per is None else per[i]
            dim = getattr(c, "head_dim", None) or config.hidden_size // heads
            shapes.append((getattr(c, "num_key_value_heads", None) or heads, dim))
        sources = tuple(range(n))
        if getattr(config, "num_kv_shared_layers", 0):  # "reuse" reads its type's "store" layer
            modes, types = config.kv_sharing_modes, config.layer_types
            store = {types[i]: i for i in range(n) if modes[i] == "store"}
            own = [i for i in range(n) if modes[i] != "reuse"]
            sources = tuple(
                own.index(store[types[i]] if modes[i] == "reuse" else i) for i in range(n)
            )
            shapes = [shapes[i] for i in own]
        widest = max(shapes, key=lambda hd: hd[0] * hd[1])
        if len(set(shapes)) == 1 and sources == tuple(range(n)):
            return cls(n, *widest, dtype)
        return cls(len(shapes), *widest, dtype, tuple(shapes), sources)

    def shape(self, layer: int) -> tuple[int, int]:
        """(kv_heads, head_dim) of cache layer `layer`."""
        return self.shapes[layer] if self.shapes else (self.kv_heads, self.head_dim)

    def source(self, layer: int) -> int:
        """The cache layer attention layer `layer` reads (and writes, if it `owns` it)."""
        return self.sources[layer] if self.sources else layer

    def owns(self, layer: int) -> bool:
        """Whether attention layer `layer` writes its cache layer (a shared-KV layer reads an
        earlier layer's keys and values, written there)."""
        return not self.sources or self.sources.index(self.sources[layer]) == layer

    @property
    def elem_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def row_bytes_of(self, layer: int) -> int:
        """Keys (or values) of one token in cache layer `layer`."""
        heads, dim = self.shape(layer)
        return heads * dim * self.elem_bytes

    @property
    def row_bytes(self) -> int:
        """Keys (or values) of one token in the widest layer."""
        return self.kv_heads * self.head_dim * self.elem_bytes

    def bytes_per_token(self) -> int:
        return 2 * sum(self.row_bytes_of(layer) for layer in range(self.n_layers))


class BlockPool:
    """Block ids 0..capacity-1 on a free stack; at most `limit` of them handed out at once."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise PwctlError("the KV cache needs at least one block: raise --memory-budget")
        self.capacity = capacity
        self.limit = capacity
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def available(self) -> int:
        """Blocks that may be handed out now (free and under the limit)."""
        return max(0, min(len(self._free), self.limit - self.used))

    def set_limit(self, n_blocks: int) -> None:
        self.limit = max(0, min(self.capacity, int(n_blocks)))

    def take(self, n: int) -> list[int] | None:
        """`n` block ids, or None (nothing taken) when fewer are available."""
        if n > self.available:
            return None
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken

    def give_back(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


class SlabSource(Protocol):
    """A pool of fixed-size device slabs the KV cache borrows from (PagedExperts)."""

    arena: torch.Tensor  # uint8 [n_slabs, slab_bytes]
    slab_bytes: int

    def lend(self, n: int) -> np.ndarray | None: ...

    def give_back(self, ids: np.ndarray) -> None: ...

    def drain(self) -> None: ...


@dataclass(frozen=True)
class KVRows:
    """Cache rows of some tokens, located for every layer at once (`KVCache.locate`): `slots`
    [T]; on arena storage also `units` [2 * n_layers, T, units a row], the arena units of layer
    l's keys at 2l and its values at 2l + 1. A step locates its rows once and every layer
    indexes them: the address arithmetic is ~8 small GPU ops, which redone per layer, for keys
    and values, on every read and write were a quarter of an eager decode step's GPU ops."""

    slots: torch.Tensor
    units: torch.Tensor | list[torch.Tensor] | None = None  # a list where layers' rows differ


def _unit_bytes(layout: KVLayout, slab_bytes: int) -> int:
    """The largest power of two dividing every layer's row bytes, at most a slab."""
    rows = [layout.row_bytes_of(layer) for layer in range(layout.n_layers)]
    return min([r & -r for r in rows] + [slab_bytes])


class KVCache:
    def __init__(
        self,
        layout: KVLayout,
        capacity: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        slabs: SlabSource | None = None,
    ):
        """`slabs`: keep the blocks in this arena's slabs (taken when needed) instead of own
        tensors allocated for `capacity` blocks."""
        self.layout = layout
        self.block_size = block_size
        self.pool = BlockPool(capacity)
        self.tables: dict[int, list[int]] = {}
        self._arrays: dict[int, np.ndarray] = {}  # `table_array`'s, dropped when a table changes
        self.slabs = slabs
        if slabs is not None:
            self._init_slabs(slabs, capacity)
            return
        shapes = [(capacity * block_size, *layout.shape(i)) for i in range(layout.n_layers)]
        self.k, self.v = (
            [torch.zeros(shape, dtype=layout.dtype, device=device) for shape in shapes]
            for _ in range(2)
        )

    def _init_slabs(self, slabs: SlabSource, capacity: int) -> None:
        lay, S, bs = self.layout, slabs.slab_bytes, self.block_size
        unit = _unit_bytes(lay, S)
        # units per row of each (layer, kv), and where its rows start in a block (units)
        self._upr = [lay.row_bytes_of(r // 2) // unit for r in range(2 * lay.n_layers)]
        first = np.concatenate([[0], np.cumsum(self._upr)[:-1] * bs]).tolist()
        self._ups = S // unit  # units per slab
        self._unit_elems = unit // lay.elem_bytes
        self.slabs_per_block = self.slabs_of(lay, bs, S)
        arena = slabs.arena
        # the (layer, kv) rows of one unit count are located together (a uniform layout: all)
        self._groups: dict[int, list[int]] = {}
        for r, upr in enumerate(self._upr):
            self._groups.setdefault(upr, []).append(r)
        self._first = {
            upr: torch.tensor([first[r] for r in rows], device=arena.device)
            for upr, rows in self._groups.items()
        }
        self._j = {upr: torch.arange(upr, device=arena.device) for upr in self._groups}
        self._host_slabs = np.full((capacity, self.slabs_per_block), -1, dtype=np.int64)
        self.block_slabs = torch.full(
            (capacity, self.slabs_per_block), -1, dtype=torch.long, device=arena.device
        )
        self.k = self.v = None  # type: ignore[assignment]

    @classmethod
    def from_budget(
        cls,
        layout: KVLayout,
        nbytes: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        """As many blocks as `nbytes` holds."""
        return cls(
            layout, int(nbytes) // cls.block_bytes_of(layout, block_size), block_size, device
        )

    @staticmethod
    def block_bytes_of(layout: KVLayout, block_size: int, slab_bytes: int | None = None) -> int:
        """Bytes of one block (all layers, keys and values); in whole slabs of `slab_bytes`
        when it lives in an arena."""
        if slab_bytes is None:
            return layout.bytes_per_token() * block_size
        return KVCache.slabs_of(layout, block_size, slab_bytes) * slab_bytes

    @staticmethod
    def slabs_of(layout: KVLayout, block_size: int, slab_bytes: int) -> int:
        """Slabs one block takes in an arena of `slab_bytes` slabs."""
        unit = _unit_bytes(layout, slab_bytes)
        rows = sum(layout.row_bytes_of(i) // unit for i in range(layout.n_layers))
        return -(-(2 * block_size * rows) // (slab_bytes // unit))

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one block (fixed for the cache's life; the serving loop asks every step)."""
        s = None if self.slabs is None else self.slabs.slab_bytes
        return self.block_bytes_of(self.layout, self.block_size, s)

    def slab_ids(self) -> np.ndarray:
        """Slabs held by the blocks in use (arena storage; empty otherwise)."""
        if self.slabs is None:
            return np.zeros(0, dtype=np.int64)
        ids = [b for t in self.tables.values() for b in t]
        return self._host_slabs[ids].ravel()

    @property
    def used(self) -> int:
        return self.pool.used

    @property
    def available(self) -> int:
        return self.pool.available

    def blocks_for(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.block_size)

    def need(self, seq_id: int, n_tokens: int) -> int:
        """Blocks `seq_id` must still get to hold `n_tokens` tokens in all."""
        return max(0, self.blocks_for(n_tokens) - len(self.tables.get(seq_id, ())))

    def grow(self, seq_id: int, n_tokens: int) -> bool:
        """Make room for `n_tokens` tokens of `seq_id`; False (nothing taken) if the pool can't."""
        n = self.need(seq_id, n_tokens)
        if n == 0:
            return True
        ids = self.pool.take(n)
        if ids is None:
            return False
        if self.slabs is not None and not self._take_slabs(ids):
            self.pool.give_back(ids)
            return False
        self.tables.setdefault(seq_id, []).extend(ids)
        self._arrays.pop(seq_id, None)
        return True

    def table_array(self, seq_id: int) -> np.ndarray:
        """`seq_id`'s block table as an int64 array, made once per change of the table (a
        decode step copies every running sequence's table into its inputs: from a list, 32
        sequences' tables took ~0.2 ms of host time a step on the 2-core dev VM)."""
        arr = self._arrays.get(seq_id)
        if arr is None:
            arr = self._arrays[seq_id] = np.asarray(self.tables[seq_id], dtype=np.int64)
        return arr

    def _take_slabs(self, ids: list[int]) -> bool:
        """Slabs of the arena for blocks `ids`; waits for retiring slabs once if short."""
        n = len(ids) * self.slabs_per_block
        assert self.slabs is not None  # blocks take slabs only from a source
        got = self.slabs.lend(n)
        if got is None:  # slabs still retiring behind fences: wait for them once
            self.slabs.drain()
            got = self.slabs.lend(n)
        if got is None:
            return False
        rows = got.astype(np.int64).reshape(len(ids), self.slabs_per_block)
        self._host_slabs[ids] = rows
        dev = self.block_slabs.device  # queued copies: a step may still be running
        self.block_slabs[to_device(ids, torch.long, dev)] = to_device(rows, torch.long, dev)
        return True

    def free(self, seq_id: int) -> int:
        """Give every block of `seq_id` back; returns how many."""
        ids = self.tables.pop(seq_id, [])
        self._arrays.pop(seq_id, None)
        if self.slabs is not None and ids:
            self.slabs.give_back(self._host_slabs[ids].ravel().astype(np.int32))
            self._host_slabs[ids] = -1
        self.pool.give_back(ids)
        return len(ids)

    def slots(self, seq_id: int, start: int, stop: int) -> torch.Tensor:
        """Cache rows of tokens start..stop-1 of `seq_id` (its blocks must cover them)."""
        table = torch.tensor(self.tables[seq_id], dtype=torch.long)
        return self.block_rows(table, torch.arange(start, stop, dtype=torch.long))

    def block_rows(self, blocks: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Cache rows [..., P] of positions `pos` [P] in block tables `blocks` [..., blocks]."""
        return blocks[..., pos // self.block_size] * self.block_size + pos % self.block_size

    def locate(self, slots: torch.Tensor) -> KVRows:
        """Rows `slots` (cache rows, e.g. from `slots()`) for every layer: valid while no block
        of theirs changes hands (within one step)."""
        if self.slabs is None:
            return KVRows(slots.to(self.k[0].device))
        slots = slots.to(self.block_slabs.device)
        block, s = slots // self.block_size, slots % self.block_size
        units: list[torch.Tensor] = [slots] * len(self._upr)
        for upr, rows in self._groups.items():
            row = self._first[upr][:, None] + s[None, :] * upr  # [group rows, T]
            unit = row[..., None] + self._j[upr]  # [group rows, T, units a row]
            slab = self.block_slabs[block[None, :, None], unit // self._ups]
            located = slab * self._ups + unit % self._ups
            if len(rows) == len(self._upr):  # uniform: one tensor, every layer's rows in order
                return KVRows(slots, located)
            for i, r in enumerate(rows):
                units[r] = located[i]
        return KVRows(slots, units)

    def write(
        self, layer: int, rows: KVRows | torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Keys and values [T, kv_heads, head_dim] of `layer` into `rows` (located, or slots)."""
        rows = rows if isinstance(rows, KVRows) else self.locate(rows)
        if rows.units is None:
            self.k[layer][rows.slots] = key.to(self.k[layer].dtype)
            self.v[layer][rows.slots] = value.to(self.v[layer].dtype)
            return
        arena = self._units()
        for kv, x in ((0, key), (1, value)):
            units = x.to(arena.dtype).reshape(-1, self._upr[2 * layer + kv], self._unit_elems)
            arena[rows.units[2 * layer + kv]] = units

    def read(self, layer: int, rows: KVRows | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [L, kv_heads, head_dim] of `layer` at `rows` (located, or slots)."""
        rows = rows if isinstance(rows, KVRows) else self.locate(rows)
        if rows.units is None:
            return self.k[layer][rows.slots], self.v[layer][rows.slots]
        shape, arena = self.layout.shape(layer), self._units()
        return tuple(  # type: ignore[return-value]
            arena[rows.units[2 * layer + kv]].view(-1, *shape) for kv in (0, 1)
        )

    def _units(self) -> torch.Tensor:
        """The arena as [units, unit elements] of the cache's dtype (a view, taken per call:
        the cache keeps no reference to an arena its source may replace)."""
        assert self.slabs is not None  # units exist only over a source's arena
        return self.slabs.arena.view(-1).view(self.layout.dtype).view(-1, self._unit_elems)
