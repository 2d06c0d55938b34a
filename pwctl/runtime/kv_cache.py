"""Paged KV cache: one pool of fixed-size token blocks shared by every sequence, a block table
per sequence, blocks back to the pool when a sequence finishes, is aborted or preempted.

The pool is allocated once for the most blocks the memory budget could ever give the KV cache
(`capacity`); `limit` is how many of them may be in use now (the memory budget moves it as the
planner frees or takes back plane bytes). Keys and values of layer `l` live in `k[l]`, `v[l]`
of shape [capacity * block_size, kv_heads, head_dim]: token `t` of a sequence sits at slot
`table[t // block_size] * block_size + t % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pwctl.errors import PwctlError


@dataclass(frozen=True)
class KVLayout:
    """What one token costs in the cache: K and V of every attention layer."""

    n_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, config: object, dtype: torch.dtype = torch.float32) -> KVLayout:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype)

    def bytes_per_token(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.kv_heads * self.head_dim * elem


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


class KVCache:
    def __init__(
        self,
        layout: KVLayout,
        capacity: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
    ):
        self.layout = layout
        self.block_size = block_size
        self.pool = BlockPool(capacity)
        self.tables: dict[int, list[int]] = {}
        shape = (capacity * block_size, layout.kv_heads, layout.head_dim)
        self.k = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.n_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.n_layers)
        ]

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
    def block_bytes_of(layout: KVLayout, block_size: int) -> int:
        return layout.bytes_per_token() * block_size

    @property
    def block_bytes(self) -> int:
        return self.block_bytes_of(self.layout, self.block_size)

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
        self.tables.setdefault(seq_id, []).extend(ids)
        return True

    def free(self, seq_id: int) -> int:
        """Give every block of `seq_id` back; returns how many."""
        ids = self.tables.pop(seq_id, [])
        self.pool.give_back(ids)
        return len(ids)

    def slots(self, seq_id: int, start: int, stop: int) -> torch.Tensor:
        """Cache rows of tokens start..stop-1 of `seq_id` (its blocks must cover them)."""
        table = torch.tensor(self.tables[seq_id], dtype=torch.long)
        pos = torch.arange(start, stop, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
