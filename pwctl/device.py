"""`--device`: the one parser every command uses (cpu, cuda, cuda:N or auto)."""

from __future__ import annotations

import re

from pwctl.errors import PwctlError

CHOICES = "cpu, cuda, cuda:N or auto"


def parse_device(text: str) -> str:
    """The torch device a command runs on. "auto" is CUDA when a device is visible, else the
    CPU; a CUDA device that is not visible is an error here, before anything loads. torch is
    imported only when CUDA is named (the CPU path never waits for it)."""
    name = text.strip().lower()
    if name == "cpu":
        return "cpu"
    m = re.fullmatch(r"cuda(?::([0-9]{1,4}))?", name)
    if m is None and name != "auto":
        raise PwctlError(f"--device {text!r}: use {CHOICES}")
    visible = _cuda_devices()
    if name == "auto":
        return "cuda" if visible else "cpu"
    if not visible:
        raise PwctlError(f"--device {name}: no CUDA device visible")
    if m is not None and m.group(1) is not None:
        index = int(m.group(1))
        if index >= visible:
            raise PwctlError(
                f"--device {name}: {visible} CUDA device(s) visible (cuda:0..cuda:{visible - 1})"
            )
        return f"cuda:{index}"
    return "cuda"


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
