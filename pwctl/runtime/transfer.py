"""Copies between the host and the device that never wait for the GPU: through pinned host
memory, queued on the current stream. A pageable `.to(device)` (and `torch.tensor(...,
device=cuda)`) or a device tensor's `.tolist()` synchronizes the stream, so it waits for every
step already queued: what overlapped decode steps (runtime/engine/batcher.py) cannot afford.
torch's caching host allocator keeps a pinned buffer alive until its queued copy has run."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class HostCopies:
    """Device tensors' copies on their way to the host, queued behind the work launched so far;
    `wait` returns them once they have landed (waiting for that point alone, not for work
    queued after it). CPU tensors are their own copies; None stays None."""

    tensors: tuple[torch.Tensor | None, ...]
    copied: torch.cuda.Event | None = None

    @classmethod
    def queue(cls, *tensors: torch.Tensor | None) -> HostCopies:
        if not any(t is not None and t.is_cuda for t in tensors):
            return cls(tensors)
        copied = torch.cuda.Event()
        host = tuple(None if t is None else to_host(t) for t in tensors)
        copied.record()
        return cls(host, copied)

    def wait(self) -> tuple[torch.Tensor | None, ...]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.tensors
