"""The prompt-residual model a pack carries (residual.json, fitted by `pwctl fit-residual`,
build/residual.py): per MoE layer, a ridge regression from three input-norm features of a
sequence to log(damage of that sequence / average damage). Plain JSON, never pickled; the
runtime uses it only when it explains enough held-out variance (`usable`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pwctl.errors import PwctlError
from pwctl.format.pack import Pack, write_atomic

RESIDUAL_JSON = "residual.json"
MIN_R2 = 0.1  # the runtime uses the residual only if it explains this much held-out variance


@dataclass
class ResidualModel:
    layers: list[int]
    mean: list[float]  # feature standardisation
    scale: list[float]
    coef: list[list[float]]  # [layer][feature]
    intercept: list[float]
    metrics: dict[str, Any]

    def log_ratio(self, layer: int, features: np.ndarray) -> np.ndarray:
        """Predicted log(damage / average damage) for features [..., 3] at `layer`."""
        li = self.layers.index(layer)
        return self._z(features) @ np.asarray(self.coef[li]) + self.intercept[li]

    def layer_factors(self, layers: list[int], features: np.ndarray) -> np.ndarray:
        """`factor` of every layer in `layers` at its own row of `features` [len(layers), 3]
        (one step's features at each MoE layer), in one go."""
        rows = [self.layers.index(layer) for layer in layers]
        coef, intercept = np.asarray(self.coef)[rows], np.asarray(self.intercept)[rows]
        return np.exp(np.einsum("lf,lf->l", self._z(features), coef) + intercept)

    def _z(self, features: np.ndarray) -> np.ndarray:
        """Standardised features."""
        return (np.asarray(features, dtype=np.float64) - self.mean) / self.scale

    @property
    def usable(self) -> bool:
        """Whether it predicts held-out sequences well enough for the runtime to use it."""
        return self.metrics.get("r2_test", 0.0) >= MIN_R2

    def factor(self, layer: int, features: np.ndarray) -> np.ndarray:
        return np.exp(self.log_ratio(layer, features))

    def save(self, pack: Pack) -> None:
        write_atomic(pack.path / RESIDUAL_JSON, json.dumps(asdict(self), indent=1).encode())

    @classmethod
    def load(cls, pack: Pack) -> ResidualModel:
        path = pack.path / RESIDUAL_JSON
        if not path.is_file():
            raise PwctlError(f"{pack.path}: no residual model; run `pwctl fit-residual`")
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise PwctlError(f"{path}: corrupt residual model ({e})") from None
