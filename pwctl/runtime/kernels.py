"""Launchers for the CUDA kernels in `cuda/moe.cu` (CuPy RawModule: NVRTC at first use, cached on
disk by CuPy). CuPy is imported here only, lazily: the CPU path never needs it. Kernels run on
torch's current stream and take raw device pointers, so torch tensors are passed as they are."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from pwctl.errors import PwctlError

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda" / "moe.cu"
TOKEN_TILES = (1, 2, 4, 8)  # decode kernels are compiled for at most this many tokens a slot
WARPS = 8  # warps per block (cuda/moe.cu)
ROWS = {1: 4, 2: 4, 4: 2, 8: 1}  # rows per warp of each token tile (cuda/moe.cu ENTRY)
DECODE_MAX_TOKENS = TOKEN_TILES[-1]


@functools.cache
def module():
    try:
        import cupy
    except ImportError:
        raise PwctlError(
            "the CUDA kernels need CuPy: pip install 'pwctl[cuda13]' (or [cuda12])"
        ) from None
    if not CUDA_SRC.exists():
        raise PwctlError(f"{CUDA_SRC}: kernel source missing (pwctl must run from its checkout)")
    major, minor = torch.cuda.get_device_capability()
    return cupy.RawModule(
        code=CUDA_SRC.read_text(),
        options=("-std=c++17", f"--gpu-architecture=sm_{major}{minor}"),
    )


@functools.cache
def _external(handle: int):
    import warnings

    import cupy

    with warnings.catch_warnings():  # ExternalStream: deprecated in CuPy 14, still the way to
        warnings.simplefilter("ignore", DeprecationWarning)  # wrap a raw handle on 12 and 13
        return cupy.cuda.ExternalStream(handle)


def _stream():
    return _external(torch.cuda.current_stream().cuda_stream)


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def launch(
    name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0
) -> None:
    _function(name)(grid, block, args, stream=_stream(), shared_mem=shared_mem)


@functools.cache
def _function(name: str):
    return module().get_function(name)


def token_tile(n: int) -> int:
    """The smallest compiled token tile holding `n` tokens per slot."""
    for t in TOKEN_TILES:
        if n <= t:
            return t
    raise ValueError(f"{n} tokens per slot: decode kernels take at most {DECODE_MAX_TOKENS}")
