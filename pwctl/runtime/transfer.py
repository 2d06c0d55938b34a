"""Copies between the host and the device that never wait for the GPU: through pinned host
memory, queued on the current stream. A pageable `.to(device)` (and `torch.tensor(...,
device=cuda)`) or a device tensor's `.tolist()` synchronizes the stream, so it waits for every
step already queued: what overlapped decode steps (runtime/engine/batcher.py) cannot afford.
torch's caching host allocator keeps a pinned buffer alive until its queued copy has run."""

from __future__ import annotations

from typing import Any

import torch


def to_device(values: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list, an array or a CPU tensor) as a tensor on `device`, queued."""
    host = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor `t`, queued on the current stream (read it only
    after an event recorded behind it has completed)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)
