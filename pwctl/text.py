"""Text files -> token windows: the one reader profile, calibration and every bench share."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pwctl.errors import PwctlError


def read_texts(paths: list[Path]) -> str:
    """Plain text, or jsonl with a "text" field per line."""
    parts = []
    for path in paths:
        if not path.is_file():
            raise PwctlError(f"{path}: data file not found")
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if line.strip():
                    try:
                        parts.append(str(json.loads(line)["text"]))
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise PwctlError(
                            f"{path}:{n}: expected a JSON object with 'text'"
                        ) from None
        else:
            parts.append(path.read_text(errors="replace"))
    text = "\n\n".join(p for p in parts if p.strip())
    if not text:
        raise PwctlError(f"{', '.join(map(str, paths))}: no text in the data")
    return text


def token_ids(tokenizer, paths: list[Path], max_tokens: int | None = None) -> torch.Tensor:
    return tokenizer(read_texts(paths), return_tensors="pt").input_ids[0][:max_tokens]


def token_windows(tokenizer, path: Path, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Consecutive windows [n, seq_len] from the first `max_tokens` tokens of a file."""
    ids = token_ids(tokenizer, [path], max_tokens)
    n = ids.numel() // seq_len
    if n == 0:
        raise PwctlError(f"{path}: {ids.numel()} tokens, fewer than one window of {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


def spread_windows(tokenizer, paths: list[Path], samples: int, seq_len: int) -> torch.Tensor:
    """`samples` windows of `seq_len` tokens spread evenly over the text (varied sequences)."""
    ids = token_ids(tokenizer, paths)
    if ids.numel() < seq_len:
        raise PwctlError(f"data has {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    n = min(samples, ids.numel() // seq_len)
    starts = np.linspace(0, ids.numel() - seq_len, n).astype(int)
    return torch.stack([ids[s : s + seq_len] for s in starts])


def norm_features(x: torch.Tensor) -> torch.Tensor:
    """The prompt residual's three features of hidden states [..., tokens, hidden]: mean, max
    and standard deviation of the token L2 norms (profile fits on them, the runtime reads them)."""
    norms = x.float().norm(dim=-1)
    return torch.stack([norms.mean(-1), norms.amax(-1), norms.std(-1)], -1)
