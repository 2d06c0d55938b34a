"""Read a local Hugging Face checkpoint folder shard by shard, checking it before any work starts.

Only safetensors are read (never pickles). Every shard's header is parsed and its size checked
against the header, so a missing or truncated shard is reported by name before conversion begins.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pwctl.errors import PwctlError

MODELS_DIR = Path(__file__).parents[1] / "models"
CALIB_SAMPLE = MODELS_DIR / "samples" / "calib.txt"  # profile / fit-residual / --calib default
EVAL_SAMPLE = MODELS_DIR / "samples" / "eval.txt"  # bench default
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
MAX_HEADER = 100 * 1024 * 1024


def bundled_models() -> list[str]:
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_source(name_or_path: str | Path) -> Path:
    """A checkpoint path, or the bare name of a bundled model (e.g. `tiny-mixtral`)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    bundled = MODELS_DIR / str(name_or_path)
    if (bundled / "config.json").is_file():
        return bundled
    if path.exists():
        raise PwctlError(f"{path}: not a folder (expected a checkpoint folder with config.json)")
    names = ", ".join(bundled_models()) or "none installed"
    raise PwctlError(f"{path}: no such checkpoint folder (bundled models: {names})")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    shard: Path
    start: int  # absolute byte offset of the data in the shard

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=torch_dtype(self.dtype)).element_size()


def torch_dtype(code: str) -> torch.dtype:
    table = {
        **FLOAT_DTYPES,
        "I64": torch.int64,
        "I32": torch.int32,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "I16": torch.int16,
    }
    if code not in table:
        raise PwctlError(f"unsupported safetensors dtype {code}")
    return table[code]


def read_header(path: Path) -> dict[str, Any]:
    """Parse a safetensors header and check the file holds every byte it promises."""
    if not path.is_file():
        raise PwctlError(f"{path}: shard missing")
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise PwctlError(f"{path}: truncated shard (no header)")
        (n,) = struct.unpack("<Q", raw)
        header_len = n
        if n > min(MAX_HEADER, size - 8):
            raise PwctlError(f"{path}: truncated or corrupt shard (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PwctlError(f"{path}: corrupt safetensors header ({e})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size < 8 + n + end:
        raise PwctlError(f"{path}: truncated shard ({size} bytes, header promises {8 + n + end})")
    header["__data_start__"] = 8 + header_len
    return header


class Checkpoint:
    """A checked checkpoint folder: config, tensor index, lazy tensor reads."""

    def __init__(self, path: Path):
        self.path = path
        self.config = read_config(path)
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shards():
            header = read_header(shard)
            base = header.pop("__data_start__")
            for name, meta in header.items():
                if name != "__metadata__":
                    self.tensors[name] = TensorInfo(
                        name,
                        meta["dtype"],
                        tuple(meta["shape"]),
                        shard,
                        base + meta["data_offsets"][0],
                    )

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "?"))

    def _shards(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise PwctlError(f"{index}: unreadable index ({e})") from None
            return sorted({self.path / f for f in weight_map.values()})
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            bins = list(self.path.glob("*.bin")) + list(self.path.glob("*.pt"))
            hint = (
                " (pickle .bin/.pt checkpoints are refused: convert them to safetensors)"
                if bins
                else ""
            )
            raise PwctlError(f"{self.path}: no safetensors shards{hint}")
        return shards

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise PwctlError(f"{self.path}: tensor {name} missing")
        return self.tensors[name]

    def tensor(self, name: str) -> torch.Tensor:
        info = self.info(name)
        return self._read(info, info.start, info.shape)

    def slice(self, name: str, index: int) -> torch.Tensor:
        """One slice along dim 0 (one expert of a fused tensor) without reading the rest."""
        info = self.info(name)
        if not 0 <= index < info.shape[0]:
            raise PwctlError(f"{info.shard}: {name} has no index {index}")
        step = info.nbytes // info.shape[0]
        return self._read(info, info.start + index * step, info.shape[1:])

    @staticmethod
    def _read(info: TensorInfo, start: int, shape: tuple[int, ...]) -> torch.Tensor:
        # plain reads, not mmap: mapped pages would count in RSS and grow it to the file size
        dtype = torch_dtype(info.dtype)
        count = 1
        for s in shape:
            count *= s
        buf = bytearray(count * torch.empty((), dtype=dtype).element_size())
        with info.shard.open("rb") as f:
            f.seek(start)
            if f.readinto(buf) != len(buf):
                raise PwctlError(f"{info.shard}: truncated while reading {info.name}")
        return (
            torch.frombuffer(buf, dtype=dtype).view(shape)
            if buf
            else torch.empty(shape, dtype=dtype)
        )


def read_config(path: Path) -> dict[str, Any]:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise PwctlError(f"{path}: no config.json (not a Hugging Face checkpoint folder)")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise PwctlError(f"{cfg}: invalid JSON ({e})") from None
