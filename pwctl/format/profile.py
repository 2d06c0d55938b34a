"""The profile a pack carries (written by `pwctl profile`, build/profile.py): per block x width
damage per token and per sequence, its lower hull over bytes, three input-norm features per MoE
layer and sequence (for the residual), and the router's load per expert. Stored as
profile.safetensors + profile.json (written atomically; the JSON carries the tensor file's CRC).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pwctl.errors import PwctlError
from pwctl.format.pack import Pack, write_atomic

PROFILE_TENSORS = "profile.safetensors"
PROFILE_JSON = "profile.json"
FEATURES = ("mean_norm", "max_norm", "std_norm")  # of token L2 norms at the MoE input


@dataclass
class Profile:
    widths: list[int]
    damage: np.ndarray  # [blocks, widths] mean damage per token (0 at the parent width)
    damage_seq: np.ndarray  # [blocks, widths, sequences]
    features: np.ndarray  # [moe_layers, sequences, 3]
    router_share: np.ndarray  # [moe_layers, experts]: share of routed slots per expert
    meta: dict[str, Any] = field(default_factory=dict)
    proxy: np.ndarray | None = None  # [blocks, widths] when measured and proxy both ran

    @property
    def hull(self) -> np.ndarray:
        return self.hull_and_mask[0]

    @property
    def hull_and_mask(self) -> tuple[np.ndarray, np.ndarray]:
        return lower_hull(np.asarray(self.meta["bytes"], dtype=np.float64), self.damage)

    def save(self, pack: Pack) -> None:
        hull, on_hull = self.hull_and_mask
        tensors = {
            "damage": self.damage,
            "damage_seq": self.damage_seq,
            "hull": hull,
            "on_hull": on_hull.astype(np.uint8),
            "features": self.features,
            "router_share": self.router_share,
        }
        if self.proxy is not None:
            tensors["proxy"] = self.proxy
        raw = st_save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()})
        write_atomic(pack.path / PROFILE_TENSORS, raw)
        meta = {**self.meta, "widths": self.widths, "crc32": zlib.crc32(raw)}
        write_atomic(pack.path / PROFILE_JSON, json.dumps(meta, indent=1).encode())

    @classmethod
    def load(cls, pack: Pack) -> Profile:
        jpath, tpath = pack.path / PROFILE_JSON, pack.path / PROFILE_TENSORS
        if not jpath.is_file() or not tpath.is_file():
            raise PwctlError(f"{pack.path}: pack has no profile; run `pwctl profile {pack.path}`")
        meta = json.loads(jpath.read_text())
        raw = tpath.read_bytes()
        if zlib.crc32(raw) != meta.get("crc32"):
            raise PwctlError(f"{tpath}: checksum mismatch (corrupt profile); run profile again")
        t = {k: v.numpy() for k, v in st_load(raw).items()}
        return cls(
            meta["widths"],
            t["damage"],
            t["damage_seq"],
            t["features"],
            t["router_share"],
            meta,
            t.get("proxy"),
        )


def lower_hull(nbytes: np.ndarray, damage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per block: damage made non-increasing in width, then its lower convex hull over
    (bytes, damage), evaluated at every width; also which widths are hull vertices."""
    mono = np.maximum.accumulate(damage[:, ::-1].clip(min=0), axis=1)[:, ::-1]
    hull = np.empty_like(mono)
    on = np.zeros(mono.shape, dtype=bool)
    for i in range(mono.shape[0]):
        x, y = nbytes[i], mono[i]
        keep: list[int] = []
        for j in range(len(x)):  # monotone chain, x ascending with width
            while len(keep) >= 2:
                a, b = keep[-2], keep[-1]
                if (y[b] - y[a]) * (x[j] - x[a]) >= (y[j] - y[a]) * (x[b] - x[a]):
                    keep.pop()
                else:
                    break
            keep.append(j)
        on[i, keep] = True
        hull[i] = np.interp(x, x[keep], y[keep])
    return hull, on
