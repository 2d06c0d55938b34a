"""Launches of the CUDA kernels (`build`'s modules) on torch's current stream, and the driver's
occupancy figures the grids are sized by. Kernels take raw device pointers, so torch tensors are
passed as they are."""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading

import numpy as np
import torch

from pwctl.errors import PwctlError
from pwctl.kernels import build, geometry, registry


def _current_stream(device: int) -> int:
    """torch's current stream on `device`, as a raw handle (the kernels run on it)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # one C call; what Triton uses
    return raw(device) if raw else torch.cuda.current_stream(device).cuda_stream


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


_CODES: dict[type, str] = {
    np.uint64: "Q",
    np.int64: "q",
    np.uint32: "I",
    np.int32: "i",
    np.float32: "f",
}


@functools.lru_cache(maxsize=64)
def param_layout(types: tuple[type, ...]) -> struct.Struct:
    """A kernel's parameters packed as CUDA lays them out: in order, each at its natural
    alignment, nothing after the last (`struct`'s native mode does exactly that)."""
    return struct.Struct("@" + "".join(_CODES[t] for t in types))


class _Params(threading.local):
    """This thread's packed kernel parameters and the `extra` array of cuLaunchKernel(Ex) that
    points at them. The driver copies the parameters before the launch call returns, so one
    buffer serves every launch. One packed buffer instead of CuPy's per-argument conversion:
    the eager decode is host-bound on the many-expert shapes
    (docs/decisions/011-prepared-launches.md)."""

    def __init__(self) -> None:
        self.data = ctypes.create_string_buffer(4096)
        self.size = ctypes.c_size_t(0)
        data, size = ctypes.addressof(self.data), ctypes.addressof(self.size)
        self.extra = (ctypes.c_void_p * 5)(1, data, 2, size, 0)  # BUFFER_POINTER, BUFFER_SIZE, END
        self.address = ctypes.addressof(self.extra)
        self.pdl_configs: dict[tuple, _LaunchConfig] = {}  # by (grid, block, shared memory)

    def pack(self, args: tuple) -> int:
        layout = param_layout(tuple(map(type, args)))
        layout.pack_into(self.data, 0, *args)
        self.size.value = layout.size
        return self.address


_params = _Params()
_POINTER = struct.Struct("@Q")


def launch(
    name: str,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple,
    shared_mem: int = 0,
    early: bool = False,
) -> None:
    """Launch kernel `name` on torch's current stream. `args`: np.uint64 (pointers, `ptr`),
    np.int64, np.int32 or np.float32 values, as the kernel declares them. `early`: the kernel
    may start before the previous kernel on the stream has finished (programmatic dependent
    launch, Hopper on): it waits (`griddepcontrol.wait`) before it reads what that kernel wrote.
    Eager launches too (launch configurations made once, `_pdl_config`): the engine's decode
    layer 1.3-6.6 us faster on the GPU for 0.5-4 us more host time (docs/decisions/012-pdl.md)."""
    launch_packed(name, grid, block, _params.pack(args), shared_mem, early)


class Prepared:
    """A launch whose parameters are packed once: `launch`'s arguments, of which those at
    positions `holes` (pointers) are given anew at each call. For launches a call repeats with
    the same buffers: an eager decode is host-bound, and building and packing ~30 arguments a
    launch was most of its Python (docs/decisions/011-prepared-launches.md)."""

    def __init__(
        self,
        name: str,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple,
        holes: tuple[int, ...] = (),
        shared_mem: int = 0,
        early: bool = False,
    ) -> None:
        types = tuple(map(type, args))
        if any(types[i] is not np.uint64 for i in holes):
            raise ValueError("a launch's holes must be pointers (np.uint64)")
        layout = param_layout(types)
        self.data, self.size = layout.pack(*args), layout.size
        self.count, self.holes = len(args), holes  # (the tests check them against the kernel)
        self.offsets = tuple(_offset(types, i) for i in holes)
        self.name, self.grid, self.block = name, grid, block
        self.shared_mem, self.early = shared_mem, early

    def __call__(self, *pointers: int) -> None:
        """Launch with `pointers` (ints: `Tensor.data_ptr()`, 0 for none) in the holes."""
        p = _params
        ctypes.memmove(p.data, self.data, self.size)
        for off, v in zip(self.offsets, pointers, strict=True):
            _POINTER.pack_into(p.data, off, v)
        p.size.value = self.size
        launch_packed(self.name, self.grid, self.block, p.address, self.shared_mem, self.early)


@functools.lru_cache(maxsize=256)
def _offset(types: tuple[type, ...], i: int) -> int:
    """Byte offset of parameter i in `param_layout(types)`: the size up to and including it (native
    alignment pads before a field, never after the last) less its own size."""
    codes = "".join(_CODES[t] for t in types[: i + 1])
    return struct.calcsize("@" + codes) - struct.calcsize("@" + codes[-1])


def launch_packed(
    name: str,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    extra: int,
    shared_mem: int = 0,
    early: bool = False,
) -> None:
    """Where every launch ends (`launch`, `Prepared`): `extra` is cuLaunchKernel's array, which
    points at this thread's packed parameters (`_params`)."""
    device = torch.cuda.current_device()
    func = _handle(name, device)
    if shared_mem > 48 << 10:
        _opt_in(name, shared_mem, device)
    grid, block = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
    stream = _current_stream(device)
    if early and has_pdl():
        _launch_pdl(func, grid, block, extra, shared_mem, stream)
    else:
        _launch_kernel()(func, *grid, *block, shared_mem, stream, 0, extra)


@functools.cache
def _launch_kernel():
    """cuLaunchKernel through CuPy's driver binding (a thin Cython call that raises on error)."""
    from cupy_backends.cuda.api import driver

    return driver.launchKernel


@functools.cache
def has_pdl() -> bool:
    """Programmatic dependent launch: compute capability 9.0 or later, and the driver's
    cuLaunchKernelEx (CUDA 12+). PWCTL_NO_PDL=1 turns it off (A/B timing)."""
    if os.environ.get("PWCTL_NO_PDL") == "1" or torch.cuda.get_device_capability()[0] < 9:
        return False
    return hasattr(_libcuda(), "cuLaunchKernelEx")


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, padding, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttr)),
        ("num_attrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _launch_kernel_ex():
    fn = _libcuda().cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def _pdl_config(grid: tuple, block: tuple, shared_mem: int) -> _LaunchConfig:
    """This thread's launch configuration of a grid, made once: a launch sets only its stream."""
    key = (grid, block, shared_mem)
    config = _params.pdl_configs.get(key)
    if config is None:
        attr = _LaunchAttr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1  # programmaticStreamSerializationAllowed
        g, b = (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block)
        config = _LaunchConfig(g, b, shared_mem, None, ctypes.pointer(attr), 1)
        config.attr = attr  # kept alive with the config that points at it
        _params.pdl_configs[key] = config
    return config


def _launch_pdl(func: int, grid: tuple, block: tuple, extra: int, shared_mem: int, stream: int):
    config = _pdl_config(grid, block, shared_mem)
    config.stream = stream
    err = _launch_kernel_ex()(ctypes.byref(config), ctypes.c_void_p(func), None, extra)
    if err != 0:
        raise PwctlError(f"cuLaunchKernelEx failed with CUDA driver error {err}")


@functools.cache
def _function(name: str):
    """The kernel of launch name `name` (`registry.qualified`: the cubin's name, maybe with a
    variant)."""
    return build.module(name).get_function(registry.unqualified(name)[0])


@functools.cache
def _handle(name: str, device: int) -> int:
    """The CUfunction of kernel `name` on `device` (CuPy loads the module there on first use)."""
    with torch.cuda.device(device):
        return _function(name).kernel.ptr


def reload() -> None:
    """Forget the loaded modules and every handle taken from them, so that the next launch loads
    the sources (`build.use_sources`) or `PWCTL_CUBIN` afresh (development A/B of kernel variants
    in one process)."""
    build.forget()
    for cached in (_function, _handle, _opt_in, _occupancy):
        cached.cache_clear()


@functools.cache
def _opt_in(name: str, shared_mem: int, device: int) -> None:
    """Allow `shared_mem` bytes of dynamic shared memory above the 48 KB default (once: reading the
    attribute is a driver call, and prefill launches every layer)."""
    with torch.cuda.device(device):
        f = _function(name)
        if f.max_dynamic_shared_size_bytes < shared_mem:
            f.max_dynamic_shared_size_bytes = shared_mem


def ctas_per_sm(name: str, threads: int) -> int:
    """CTAs of kernel `name` (`threads` a CTA, no dynamic shared memory) resident at once on one
    SM of the current device."""
    return _occupancy(name, threads, torch.cuda.current_device())


def resident_ctas(name: str) -> int:
    """CTAs of decode kernel `name` (WARPS warps a CTA) the whole GPU holds at once: one wave."""
    return ctas_per_sm(name, 32 * geometry.WARPS) * geometry.sm_count()


def resident_prefill_ctas(name: str) -> int:
    """CTAs of sm_90a prefill kernel `name` (PREFILL_WARPS warps and PREFILL_WG_SMEM bytes of
    shared memory a CTA) the whole GPU holds at once: one wave."""
    device = torch.cuda.current_device()
    smem = geometry.PREFILL_WG_SMEM
    _opt_in(name, smem, device)  # the driver counts none above the function's limit
    return _occupancy(name, 32 * geometry.PREFILL_WARPS, device, smem) * geometry.sm_count()


@functools.cache
def _occupancy(name: str, threads: int, device: int, shared_mem: int = 0) -> int:
    n = ctypes.c_int()
    fn = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor
    handle = ctypes.c_void_p(_handle(name, device))
    err = fn(ctypes.byref(n), handle, threads, ctypes.c_size_t(shared_mem))
    if err != 0:
        raise PwctlError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor: CUDA driver error {err}")
    return n.value
