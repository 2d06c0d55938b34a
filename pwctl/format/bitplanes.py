"""The bit-plane layout: the one piece of format code the quantizer, the CPU reference and the
CUDA kernels share (docs/FORMAT.md).

A block W [rows, cols] at max width B is B planes, plane 0 the most significant bit. Plane p is an
int32 array [rows, words] with words = 4 ceil(cols / 128): bit j of word w in row n is bit (B-1-p)
of the label of column 32w + j (little-endian, padding columns are label 0). The b-bit label is the
top b bits, i.e. the first b planes. The width-b table is fp16 [rows / rows_per_table, 2^b]: row n
reads table row n // rows_per_table.

A plane is stored tiled (`tile`): in 16-byte units of 4 words, [rows / 8][words / 4][8 rows][4
words], rows padded to a multiple of 8 with label 0. A warp that reads one unit of each of 8 rows
from 4 adjacent units then reads 512 contiguous bytes, where the row-major layout gave it 8 pieces
of 64 bytes (cuda/planes.cuh `tiled`; Mixtral decode 3-7.5% faster,
docs/decisions/025-tiled-planes.md).
"""

from __future__ import annotations

import torch

WORD = 32
UNIT_WORDS = 4  # words of a 16-byte unit of one row
GROUP_ROWS = 8  # rows whose units a plane interleaves


def words_per_row(cols: int) -> int:
    """Words a row of a plane holds: whole 16-byte units."""
    unit = WORD * UNIT_WORDS
    return (cols + unit - 1) // unit * UNIT_WORDS


def plane_rows(rows: int) -> int:
    """Rows a stored plane holds: whole groups of GROUP_ROWS."""
    return (rows + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS


def bits_nbytes(rows: int, words: int) -> int:
    """Bytes of a stored plane's bits (its chunk's first part, before the table it carries)."""
    return plane_rows(rows) * words * 4


def group_bytes(words: int) -> int:
    """Bytes of one group of rows of a plane: the least a slab must hold (a group's rows then
    cross at most one slab edge, which the kernels' row pointers allow for)."""
    return GROUP_ROWS * words * 4


def tile(plane: torch.Tensor) -> torch.Tensor:
    """A plane int32 [rows, words] in its stored order: flat [plane_rows(rows) * words]."""
    rows, words = plane.shape
    padded = torch.zeros(plane_rows(rows), words, dtype=plane.dtype, device=plane.device)
    padded[:rows] = plane
    groups = padded.view(-1, GROUP_ROWS, words // UNIT_WORDS, UNIT_WORDS)
    return groups.permute(0, 2, 1, 3).reshape(-1)


def untile(stored: torch.Tensor, rows: int, words: int) -> torch.Tensor:
    """The plane int32 [rows, words] from its stored order (`tile`)."""
    groups = stored.view(-1, words // UNIT_WORDS, GROUP_ROWS, UNIT_WORDS)
    return groups.permute(0, 2, 1, 3).reshape(-1, words)[:rows]


def pack_planes(labels: torch.Tensor, bits: int) -> torch.Tensor:
    """labels [rows, cols] (values < 2^bits) -> int32 planes [bits, rows, words], MSB first."""
    rows, cols = labels.shape
    words = words_per_row(cols)
    lab = torch.zeros(rows, words * WORD, dtype=torch.int64, device=labels.device)
    lab[:, :cols] = labels.to(torch.int64)
    shifts = torch.arange(WORD, device=labels.device)
    planes = []
    for p in range(bits):
        bit = (lab >> (bits - 1 - p)) & 1
        planes.append((bit.view(rows, words, WORD) << shifts).sum(-1))
    packed = torch.stack(planes)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_labels(planes: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 planes [b, rows, words] -> int64 b-bit labels [rows, cols]."""
    b, rows, words = planes.shape
    shifts = torch.arange(WORD, device=planes.device, dtype=torch.int32)
    lab = torch.zeros(rows, words * WORD, dtype=torch.int64, device=planes.device)
    for p in range(b):
        bit = (planes[p].unsqueeze(-1) >> shifts) & 1  # arithmetic shift is fine: & 1
        lab = (lab << 1) | bit.reshape(rows, words * WORD).to(torch.int64)
    return lab[:, :cols]


def dequantize(
    planes: torch.Tensor, table: torch.Tensor, rows_per_table: int, cols: int
) -> torch.Tensor:
    """The b-bit weights [rows, cols] (float32) from the first b planes and the width-b table."""
    lab = unpack_labels(planes, cols)
    t = table.float()
    if rows_per_table > 1:
        t = t.repeat_interleave(rows_per_table, dim=0)
    return t.gather(1, lab)
