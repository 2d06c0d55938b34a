"""What the kernels read: the slab arena, and per block its width in use and where its planes'
pages are. A device mirror of the page table's `width` and `slab_map` (the pager is their only
writer); `sync` uploads them on the compute stream after a pager commit, so every kernel launched
afterwards sees the new widths and slabs and every kernel launched before still sees the old ones
(stream order; the pager keeps dropped slabs until the fence after those kernels has passed).

`weight` reads a block back through the same pages with the format code (bitplanes.dequantize):
the CPU execution path and the reference the CUDA kernels are tested against."""

from __future__ import annotations

import numpy as np
import torch

from pwctl.format.bitplanes import bits_nbytes, dequantize, untile
from pwctl.format.pack import BlockInfo
from pwctl.kernels.launch import ptr
from pwctl.runtime.memory.page_table import PageTable, min_slab


class DeviceTable:
    def __init__(self, table: PageTable, arena: torch.Tensor, blocks: list[BlockInfo]):
        """`arena`: uint8 [n_slabs, slab_bytes] (CudaBackend.slabs, or CpuBackend.arena as a
        tensor); `blocks`: the pack's blocks in page-table order (shapes and chunk layout)."""
        s = table.slab_bytes
        if s & (s - 1):
            raise ValueError(f"slab size {s} is not a power of two")
        if arena.shape != (table.n_slabs, s) or arena.dtype != torch.uint8:
            raise ValueError("arena must be uint8 [n_slabs, slab_bytes] of the page table")
        if min_slab(blocks) > s:
            raise ValueError(f"slab size {s} is smaller than a group of rows of plane words")
        self.table, self.arena, self.blocks = table, arena, blocks
        self.device = arena.device
        self.slab_shift = s.bit_length() - 1
        self.slab_off = torch.as_tensor(table.slab_off.astype(np.int32), device=self.device)
        self.slab_map = torch.empty(table.slab_map.size, dtype=torch.int32, device=self.device)
        self.width = torch.empty(table.n_blocks, dtype=torch.int32, device=self.device)
        self._sent: dict[int, np.ndarray] = {}  # id(device tensor) -> what it holds
        self.width_version = 0  # counts width uploads: what depends on widths caches by it
        self.sync()
        # the tensors above live as long as this table: their pointers are fixed
        self._args: tuple = (ptr(arena), ptr(self.slab_map), ptr(self.slab_off), ptr(self.width))
        self._args += (np.int32(self.slab_shift), np.int32(table.max_bits))

    def sync(self) -> None:
        """Upload widths and slab map (after a pager commit; no host sync). Runs at every step
        boundary, so an array the commit left unchanged is not uploaded again."""
        if self._upload(self.width, self.table.width.astype(np.int32)):
            self.width_version += 1
        self._upload(self.slab_map, self.table.slab_map)

    @property
    def synced_width(self) -> np.ndarray:
        """The widths kernels launched from now on read (the last upload's host copy)."""
        return self._sent[id(self.width)]

    def _upload(self, dst: torch.Tensor, src: np.ndarray) -> bool:
        """Copy `src` into `dst` unless it holds it already; whether it copied."""
        src = np.ascontiguousarray(src, dtype=np.int32)
        sent = self._sent.get(id(dst))
        if sent is not None and np.array_equal(sent, src):
            return False
        self._sent[id(dst)] = src.copy()
        host = torch.from_numpy(src)
        if dst.is_cuda:  # a fresh pinned buffer per upload: the caching host allocator keeps it
            host = host.pin_memory()  # alive until its non-blocking copy has run
        dst.copy_(host, non_blocking=dst.is_cuda)
        return True

    def kernel_args(self) -> tuple:
        """The descriptor as the kernels take it (cuda/planes.cuh PAGED_ARGS)."""
        return self._args

    def chunk(self, b: int, p: int) -> torch.Tensor:
        """Plane p of block b (bits, then the table it carries) as uint8, from its slabs."""
        t = self.table
        ids = torch.as_tensor(t.slabs(b, p, p + 1).astype(np.int64), device=self.device)
        return self.arena[ids].reshape(-1)[: int(t.plane_bytes[b, p])]

    def weight(self, b: int, width: int | None = None) -> torch.Tensor:
        """Block b dequantized (float32 [rows, cols]) at `width` (default: its width in use)."""
        blk = self.blocks[b]
        w = int(self.table.width[b]) if width is None else width
        bits = bits_nbytes(blk.rows, blk.words)
        stored = [self.chunk(b, p)[:bits].view(torch.int32) for p in range(w)]
        planes = torch.stack([untile(t, blk.rows, blk.words) for t in stored])
        table = self.chunk(b, w - 1)[bits:].view(torch.float16).view(-1, 1 << w)
        return dequantize(planes, table, blk.rows_per_table, blk.cols)
