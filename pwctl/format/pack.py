"""The pack: bit-plane page files + manifest + non-expert weights (docs/FORMAT.md).

    manifest.json          format, model config, resolved MoE spec, widths, every block and plane
    planes/layerNNN.bin    per block, per plane: bits, then the table of the width it completes
    nonexpert.safetensors  embeddings, attention, norms, routers, shared-expert gates (unquantized)
    reference.safetensors  the original expert weights (the fp16 policy); optional
    config.json, tokenizer files

Plane p of a block (0 = MSB) is one chunk [bits | table for width p+1, if p+1 >= min_bits], aligned
to 256 bytes, with its own offset, size and crc32: the unit of storage, checksum and transfer.
A pack is written into a temporary folder and renamed into place when complete; an existing
pack is swapped with it in one step (`exchange`), and only a pack is ever replaced.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors.torch import load_file

from pwctl.errors import PwctlError
from pwctl.format.bitplanes import bits_nbytes, tile, untile

FORMAT = "pwctl-pack"
VERSION = 2  # 2: planes stored tiled (bitplanes.tile)
ALIGN = 256
MANIFEST = "manifest.json"
NONEXPERT = "nonexpert.safetensors"
REFERENCE = "reference.safetensors"
ST_CODES = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass
class PlaneInfo:
    offset: int
    bits_nbytes: int
    table_nbytes: int
    crc32: int

    @property
    def nbytes(self) -> int:
        return self.bits_nbytes + self.table_nbytes


@dataclass
class BlockInfo:
    name: str  # "layers.3.experts.5.gate"; shared experts are numbered after the routed ones
    layer: int
    expert: int
    shared: bool
    proj: str  # gate | up | down
    rows: int
    cols: int
    words: int  # int32 words per row per plane
    rows_per_table: int
    file: str
    planes: list[PlaneInfo]
    importance_tokens: int | None = None  # calibration tokens behind its weighting
    reference_crc32: int | None = None  # of its tensor's bytes in reference.safetensors

    def bytes_at(self, bits: int) -> int:
        """Device bytes to hold this block at `bits`: its first `bits` planes with their tables."""
        return sum(p.nbytes for p in self.planes[:bits])

    @property
    def fp16_bytes(self) -> int:
        return self.rows * self.cols * 2

    @property
    def table_rows(self) -> int:
        return self.rows // self.rows_per_table


@dataclass
class Manifest:
    model_type: str
    config: dict[str, Any]
    spec: dict[str, Any]
    min_bits: int
    max_bits: int
    weighting: str  # "calib-ex2" or "uniform"
    moe_layers: list[int]
    blocks: list[BlockInfo]
    calib: dict[str, Any] | None = None
    reference: bool = True
    source: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        blocks = [
            BlockInfo(**{**b, "planes": [PlaneInfo(**p) for p in b["planes"]]}) for b in d["blocks"]
        ]
        return cls(**{**d, "blocks": blocks})


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SafetensorsStream:
    """Write a safetensors file tensor by tensor: the header is known from shapes up front, so
    memory never holds more than the tensor being written."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        header: dict[str, Any] = {}
        offset = 0
        self._order = []
        for name, dtype, shape in entries:
            n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": ST_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            self._order.append((name, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._f: BinaryIO = path.open("wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Append the next tensor; returns the CRC-32 of its bytes."""
        want, n = self._order[self._next]
        data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        if name != want or len(data) != n:
            raise RuntimeError(f"safetensors stream: expected {want} ({n} B), got {name}")
        self._f.write(data)
        self._next += 1
        return zlib.crc32(data)

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError("safetensors stream closed before every tensor was written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def check_replaceable(out: Path, force: bool) -> None:
    """`out` may be replaced only with --force, and only if it is a pack (pwctl made it):
    a folder or file that is not a pack is never removed."""
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise PwctlError(f"{out} exists; pass --force to replace it")
    if out.is_symlink() or not out.is_dir() or not (out / MANIFEST).is_file():
        raise PwctlError(
            f"{out} exists and is not a pwctl pack (no {MANIFEST}); --force replaces only a "
            "pack: remove it yourself or choose another OUT"
        )


_RENAME_EXCHANGE = 2  # linux/fs.h


def exchange(a: Path, b: Path) -> None:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); where the system has no
    such call, two renames through a sibling name that is removed by the caller's cleanup."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        at_fdcwd = -100
        if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        if ctypes.get_errno() not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(b))
    side = b.parent / f".{b.name}.swap-{os.getpid()}"
    os.replace(b, side)
    os.replace(a, b)
    os.replace(side, a)


class PackWriter:
    """Builds a pack in a temporary sibling folder; `commit` renames it into place."""

    def __init__(self, out: Path, force: bool):
        self.out = out
        check_replaceable(out, force)
        if not out.parent.is_dir():
            raise PwctlError(f"{out.parent}: output folder's parent does not exist")
        self.tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        (self.tmp / "planes").mkdir(parents=True)
        self._files: dict[str, BinaryIO] = {}

    def add_block(
        self,
        meta: dict[str, Any],
        planes: torch.Tensor,
        tables: dict[int, torch.Tensor],
        min_bits: int,
    ) -> BlockInfo:
        """Append one block's planes (int32 [B, rows, words]) and fp16 tables to its layer file."""
        rel = f"planes/layer{meta['layer']:03d}.bin"
        f = self._files.get(rel) or self._files.setdefault(rel, (self.tmp / rel).open("wb"))
        infos = []
        for p in range(planes.shape[0]):
            bits = tile(planes[p].cpu()).numpy().astype("<i4", copy=False).tobytes()
            table = (
                tables[p + 1].cpu().to(torch.float16).numpy().tobytes()
                if p + 1 >= min_bits
                else b""
            )
            f.write(b"\0" * (-f.tell() % ALIGN))
            infos.append(
                PlaneInfo(f.tell(), len(bits), len(table), zlib.crc32(table, zlib.crc32(bits)))
            )
            f.write(bits)
            f.write(table)
        return BlockInfo(**meta, file=rel, planes=infos)

    def path(self, name: str) -> Path:
        return self.tmp / name

    def commit(self, manifest: Manifest) -> None:
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        write_atomic(self.tmp / MANIFEST, manifest.to_json().encode())
        if not self.out.exists():
            os.replace(self.tmp, self.out)
            return
        check_replaceable(self.out, force=True)  # still a pack: nothing else is ever removed
        exchange(self.tmp, self.out)  # readers see the old pack or the new one, never neither
        try:
            shutil.rmtree(self.tmp)  # the old pack, now under the temporary name
        except OSError as e:
            raise PwctlError(
                f"{self.out} is the new pack, but the old one could not be removed from "
                f"{self.tmp}: {e}"
            ) from None

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass(frozen=True)
class Fault:
    """A part of a pack that failed its checksum: plane `plane` of a block, or (plane None) its
    reference weights."""

    block: str
    plane: int | None
    path: str

    def __str__(self) -> str:
        part = "reference weights" if self.plane is None else f"plane {self.plane}"
        return f"{self.block} {part}: checksum mismatch in {self.path} (corrupt or truncated)"


def tensor_crc32(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().data)


class Pack:
    """A pack opened for reading; plane reads verify their checksum."""

    def __init__(self, path: Path):
        self.path = path
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise PwctlError(
                f"{path}: not a pwctl pack (no {MANIFEST}); make one with `pwctl convert`"
            )
        try:
            data = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise PwctlError(f"{mpath}: corrupt manifest ({e})") from None
        if data.get("format") != FORMAT:
            raise PwctlError(f"{mpath}: not a {FORMAT} manifest")
        if data.get("version") != VERSION:
            raise PwctlError(
                f"{mpath}: pack format v{data.get('version')}, this pwctl reads v{VERSION}; "
                "convert the model again with `pwctl convert`"
            )
        self.manifest = Manifest.from_dict(data)
        self.blocks = self.manifest.blocks
        self.index = {(b.layer, b.expert, b.proj): i for i, b in enumerate(self.blocks)}
        self.by_name = {b.name: i for i, b in enumerate(self.blocks)}

    @property
    def held(self) -> np.ndarray:
        """bool per block: whether this process holds the block's planes. Every block of a
        pack; one rank's share of it (runtime/parallel/rank_pack.py) only its own experts'."""
        return np.ones(len(self.blocks), dtype=bool)

    def _chunk(self, block: BlockInfo, p: int) -> bytes | None:
        """Plane p's stored bytes, or None if they fail their checksum."""
        info = block.planes[p]
        with (self.path / block.file).open("rb") as f:
            f.seek(info.offset)
            raw = f.read(info.nbytes)
        return raw if len(raw) == info.nbytes and zlib.crc32(raw) == info.crc32 else None

    def read_plane(self, block: BlockInfo, p: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Plane p's bits as stored (int32, tiled: bitplanes.untile gives [rows, words]) and its
        table (fp16) if it completes a width."""
        raw = self._chunk(block, p)
        if raw is None:
            raise PwctlError(
                f"{self.path / block.file}: checksum mismatch in {block.name} plane {p}"
                " (corrupt or truncated page file)"
            )
        return self._parse(block, p, raw)

    @staticmethod
    def _parse(block: BlockInfo, p: int, raw: bytes) -> tuple[np.ndarray, np.ndarray | None]:
        info = block.planes[p]
        bits = np.frombuffer(raw, dtype="<i4", count=bits_nbytes(block.rows, block.words) // 4)
        if not info.table_nbytes:
            return bits, None
        table = np.frombuffer(raw, dtype="<f2", offset=info.bits_nbytes)
        return bits, table.reshape(block.table_rows, -1)

    def load_block(
        self, block: BlockInfo, bits: int
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The first `bits` planes as int32 [bits, rows, words] and the tables they carry."""
        planes, tables = [], {}
        for p in range(bits):
            plane, table = self.read_plane(block, p)
            planes.append(untile(torch.from_numpy(plane.copy()), block.rows, block.words))
            if table is not None:
                tables[p + 1] = torch.from_numpy(table.copy())
        return torch.stack(planes), tables

    def verify(self, progress: Callable[[int, int], None] | None = None) -> list[Fault]:
        """Every plane of every block, and the reference weights where the manifest has their
        checksums (packs converted before it did are read as they are), checked against their
        CRC-32; `progress(bytes done, bytes in all)`. Reads the whole pack, one plane or one
        reference tensor at a time."""
        faults, done = [], 0
        checked = [b for b in self.blocks if b.reference_crc32 is not None]
        ref = self._open_reference() if checked else None
        total = sum(p.nbytes for b in self.blocks for p in b.planes)
        total += sum(b.fp16_bytes for b in checked)
        for block in self.blocks:
            bad = [p for p in range(len(block.planes)) if self._chunk(block, p) is None]
            faults += [Fault(block.name, p, str(self.path / block.file)) for p in bad]
            done += sum(p.nbytes for p in block.planes)
            if block.reference_crc32 is not None:
                if not self._reference_ok(ref, block):
                    faults.append(Fault(block.name, None, str(self.path / REFERENCE)))
                done += block.fp16_bytes
            if progress is not None:
                progress(done, total)
        return faults

    def _open_reference(self) -> Any:
        """reference.safetensors opened for reading tensor by tensor (None: unreadable)."""
        from safetensors import safe_open

        try:
            return safe_open(str(self.path / REFERENCE), "pt")
        except Exception:  # missing, truncated or garbled: safetensors' errors vary
            return None

    @staticmethod
    def _reference_ok(ref: Any, block: BlockInfo) -> bool:
        if ref is None:
            return False
        try:
            return tensor_crc32(ref.get_tensor(block.name)) == block.reference_crc32
        except Exception:  # the tensor is missing or cut short
            return False

    def reference_fault(self, block: BlockInfo, tensor: torch.Tensor) -> Fault | None:
        """A loaded reference tensor checked against the manifest's CRC (None: good, or a pack
        without reference checksums)."""
        if block.reference_crc32 is None or tensor_crc32(tensor) == block.reference_crc32:
            return None
        return Fault(block.name, None, str(self.path / REFERENCE))

    def load_good_planes(
        self, block: BlockInfo, bits: int
    ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor], Fault | None]:
        """Like load_block, but stops at the first plane that fails its checksum: the planes
        before it (None if there are none), their tables, and the fault."""
        planes: list[torch.Tensor] = []
        tables: dict[int, torch.Tensor] = {}
        for p in range(bits):
            raw = self._chunk(block, p)
            if raw is None:
                fault = Fault(block.name, p, str(self.path / block.file))
                return (torch.stack(planes) if planes else None), tables, fault
            plane, table = self._parse(block, p, raw)
            planes.append(untile(torch.from_numpy(plane.copy()), block.rows, block.words))
            if table is not None:
                tables[p + 1] = torch.from_numpy(table.copy())
        return (torch.stack(planes) if planes else None), tables, None

    def nonexpert(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / NONEXPERT))

    def reference(self) -> dict[str, torch.Tensor]:
        path = self.path / REFERENCE
        if not self.manifest.reference or not path.is_file():
            raise PwctlError(
                f"{self.path}: pack has no reference weights (converted with "
                "--no-reference), so the fp16 policy is unavailable"
            )
        return load_file(str(path))
