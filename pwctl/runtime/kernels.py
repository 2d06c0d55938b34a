"""Launchers for the CUDA kernels in `cuda/moe.cu` (CuPy RawModule: NVRTC at first use, cached on
disk by CuPy). CuPy is imported here only, lazily: the CPU path never needs it. Kernels run on
torch's current stream and take raw device pointers, so torch tensors are passed as they are."""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pwctl.errors import PwctlError


def cuda_dir() -> Path:
    """The folder of the kernels' CUDA sources: an installed wheel carries the top-level cuda/ as
    the package data pwctl/cuda (setup.py); a source checkout, or an editable install, has it
    beside pwctl/."""
    package = Path(__file__).resolve().parents[1]
    for folder in (package / "cuda", package.parent / "cuda"):
        if any(folder.glob("*.cu")):
            return folder
    return package.parent / "cuda"  # missing: `modules` says so


CUDA_DIR = cuda_dir()
CUDA_SRC = CUDA_DIR / "moe.cu"
# cuda/moe.cu's parts, each a program of its own: the kernels each holds (each kernel has its own
# guard there, so any grouping builds). Apart, they compile side by side (`modules`), grouped by
# each kernel's own NVRTC time so that no part takes much longer than the slowest kernel,
# `gate_up_n8`, alone; it comes first, so that a machine of fewer cores starts it first
# (docs/decisions/032-nvrtc-parts.md).
PARTS = (
    ("gate_up_n8",),
    ("gate_up_n4", "down_n4"),
    ("down_n8", "gate_up_pn"),
    ("gate_up_n2", "gate_up_p1", "gate_up_p1b3"),
    ("gate_up_prefill", "down_prefill", "gate_up_prefill_wg", "down_prefill_wg"),
    ("gate_up_pnb3", "down_pn", "down_pnb3", "down_p1", "down_p1b3"),
    ("gate_up_n1", "down_n1", "down_n2", "token_tiles", "prefill_prep", "decode_prep",
     "route_prep", "popc_planes"),
    ("gate_up_p1b5", "down_p1b5"),
)  # fmt: skip
PART_OF = {name: k for k, names in enumerate(PARTS) for name in names}
WARPS = 4  # warps per decode CTA (cuda/moe.cu): they split a block's columns
ROWS = 16  # block rows of one mma m-tile: a gate_up CTA's rows (of gate and of up)
PREP_THREADS = 256  # decode_prep / route_prep blocks (cuda/moe.cu PREP_THREADS)
POPC_SPLIT = 8  # popc_planes CTAs a piece: one for each word of a k-step
# calls of up to this many tokens may take the popc kernels (cuda/moe.cu gate_up_popc): their
# slots of one token on the binary mma, larger slots on the lookup in one n-tile (<= 8 tokens).
# Mixtral, H200: 1.15x the lookup kernels at 6 tokens and 4 bits, even at 8 (decisions/020)
POPC_MAX_TOKENS = 8
POPC_MAX_BITS = 4  # widest block their binary mma reads (gate_up_popc<4>; wider: their lookup)
DECODE_TILES = (1, 2, 4, 8)  # n-tiles of 8 tokens per slot compiled for decode (moe.cu *_ENTRY)
PREFILL_TOKENS = 128  # tokens of one slot per prefill pass (cuda/moe.cu PF_TOKENS)
PREFILL_ROWS = {"gate_up": 32, "down": 64}  # block rows per prefill CTA (both prefill kernels)
STAGE_BYTES = 128 * 24 + 16 * 256 * 2  # sizeof(Stage): 16 rows x 8 planes of RowPtr, tables
# dynamic shared memory of the prefill kernels (each checks its size against its struct):
# sizeof(Prefill), 4 stages + two chunks of A fragments; sizeof(PrefillWG), 4 stages + two B
# buffers of 8 k-steps x 128 tokens
PREFILL_SMEM = 4 * STAGE_BYTES + 2 * 4 * 16 * 32 * 16
PREFILL_WG_SMEM = 4 * STAGE_BYTES + 2 * 8 * 128 * 16 * 2 + 2 * 8  # and B's two mbarriers
PREFILL_WARPS = 4  # cuda/moe.cu PF_WARPS
CTAS_PER_SM = 8  # what a k-split aims for: enough warps in flight to cover memory latency
DECODE_MAX_TOKENS = 8 * DECODE_TILES[-1]
GROUP_SPLIT = 2048  # pairs from which prefill_prep groups with every warp (cuda/moe.cu)


def group_smem(experts: int, pairs: int = 0) -> int:
    """Dynamic shared memory of a launch that groups `pairs` pairs (cuda/moe.cu group_pairs): an
    int per expert and grouping warp (every warp of the block from GROUP_SPLIT pairs on)."""
    return 4 * (PREP_THREADS // 32 if pairs >= GROUP_SPLIT else 1) * experts


@functools.cache
def modules() -> tuple:
    """One CuPy RawModule a part of `cuda/moe.cu` (`PARTS`), all compiled on the first call, side
    by side: NVRTC spends nearly all its time on each kernel's own optimization, one core a
    program, and one program of every kernel held one core for minutes (docs/KERNELS.md). With
    PWCTL_CUBIN, that one cubin serves every part."""
    try:
        import cupy
    except ImportError:
        raise PwctlError(
            "the CUDA kernels need CuPy: pip install 'pwctl[cuda13]' (or [cuda12])"
        ) from None
    prebuilt = os.environ.get("PWCTL_CUBIN")
    if prebuilt:  # development: a cubin built elsewhere (nvcc) skips NVRTC's minutes on a GPU box
        if not Path(prebuilt).is_file():
            raise PwctlError(f"PWCTL_CUBIN={prebuilt}: no such file")
        return (cupy.RawModule(path=prebuilt),) * len(PARTS)
    if not CUDA_SRC.exists():
        raise PwctlError(f"{CUDA_SRC}: kernel source missing (neither installed nor checked out)")
    arch, code, device = device_arch(), CUDA_SRC.read_text(), cupy.cuda.runtime.getDevice()

    def build(part: int):  # CuPy compiles with the GIL let go, then loads on `device`
        mod = cupy.RawModule(code=code, options=part_options(arch, part))
        with cupy.cuda.Device(device):
            mod.compile()
        return mod

    return tuple(each_part(build))


def device_arch() -> str:
    """What NVRTC builds for the current device: sm_90a on Hopper (wgmma: the prefill), sm_XY
    elsewhere."""
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if has_wgmma() else "")


def program_options(arch: str, names: Iterable[str], part: int = 0) -> tuple[str, ...]:
    """NVRTC's options for a program of `cuda/moe.cu` on `arch` that holds kernels `names` (the
    others left out); `part` only labels it."""
    wanted = tuple(f"-DPWCTL_WANT_{name}=1" for name in names)
    return ("-std=c++17", f"--gpu-architecture={arch}", f"-DPWCTL_PART={part}", *wanted)


def part_options(arch: str, part: int) -> tuple[str, ...]:
    """NVRTC's options for part `part` of `cuda/moe.cu` on `arch` (tests/test_nvrtc.py builds the
    same)."""
    return program_options(arch, PARTS[part], part)


def each_part(build: Callable[[int], object]) -> list:
    """build(k) for every part k, side by side: a thread a core (NVRTC holds no GIL)."""
    with ThreadPoolExecutor(min(len(PARTS), os.cpu_count() or 1)) as pool:
        return list(pool.map(build, range(len(PARTS))))


def module(name: str):
    """The RawModule that holds kernel `name`."""
    return modules()[PART_OF[name]]


@functools.cache
def has_wgmma() -> bool:
    """Whether the device runs the sm_90a prefill kernels (warpgroup mma): Hopper (9.0) only;
    other devices take the mma.sync prefill."""
    return torch.cuda.get_device_capability() == (9, 0)


def _current_stream(device: int) -> int:
    """torch's current stream on `device`, as a raw handle (the kernels run on it)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # one C call; what Triton uses
    return raw(device) if raw else torch.cuda.current_stream(device).cuda_stream


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


_CODES = {np.uint64: "Q", np.int64: "q", np.uint32: "I", np.int32: "i", np.float32: "f"}


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
    return module(name).get_function(name)


@functools.cache
def _handle(name: str, device: int) -> int:
    """The CUfunction of kernel `name` on `device` (CuPy loads the module there on first use)."""
    with torch.cuda.device(device):
        return _function(name).kernel.ptr


def reload() -> None:
    """Forget the loaded module and every handle taken from it, so that the next launch loads
    `CUDA_SRC` or `PWCTL_CUBIN` afresh (development A/B of kernel variants in one process)."""
    for cached in (modules, _function, _handle, _opt_in, _occupancy):
        cached.cache_clear()


@functools.cache
def _opt_in(name: str, shared_mem: int, device: int) -> None:
    """Allow `shared_mem` bytes of dynamic shared memory above the 48 KB default (once: reading the
    attribute is a driver call, and prefill launches every layer)."""
    with torch.cuda.device(device):
        f = _function(name)
        if f.max_dynamic_shared_size_bytes < shared_mem:
            f.max_dynamic_shared_size_bytes = shared_mem


@functools.cache
def sm_count() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def ctas_per_sm(name: str, threads: int) -> int:
    """CTAs of kernel `name` (`threads` a CTA, no dynamic shared memory) resident at once on one
    SM of the current device."""
    return _occupancy(name, threads, torch.cuda.current_device())


def resident_ctas(name: str) -> int:
    """CTAs of decode kernel `name` (WARPS warps a CTA) the whole GPU holds at once: one wave."""
    return ctas_per_sm(name, 32 * WARPS) * sm_count()


def resident_prefill_ctas(name: str) -> int:
    """CTAs of sm_90a prefill kernel `name` (PREFILL_WARPS warps and PREFILL_WG_SMEM bytes of
    shared memory a CTA) the whole GPU holds at once: one wave."""
    device = torch.cuda.current_device()
    _opt_in(name, PREFILL_WG_SMEM, device)  # the driver counts none above the function's limit
    return _occupancy(name, 32 * PREFILL_WARPS, device, PREFILL_WG_SMEM) * sm_count()


@functools.cache
def _occupancy(name: str, threads: int, device: int, shared_mem: int = 0) -> int:
    n = ctypes.c_int()
    fn = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor
    handle = ctypes.c_void_p(_handle(name, device))
    err = fn(ctypes.byref(n), handle, threads, ctypes.c_size_t(shared_mem))
    if err != 0:
        raise PwctlError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor: CUDA driver error {err}")
    return n.value


def gate_up_runs(tiles: int, wave: int) -> int:
    """CTAs of a one-token gate_up's persistent grid (cuda/moe.cu Run): one wave when the tiles
    are more than a wave, each CTA then taking an equal share of the tiles' halves and staging
    each tile after its first without a chain of loads (`restage`); else 0, one CTA a tile."""
    return wave if tiles > wave else 0


def gate_up_shares(ctas: int, tiles: int, shared_tiles: int) -> tuple[int, int]:
    """`ctas` persistent gate_up CTAs split between `tiles` routed tiles and the shared
    expert's `shared_tiles` in proportion, each group at least one CTA and at most one a half
    tile; (0, 0) for none. With a shared expert a layer's tiles are one grid, so a second
    group's one CTA a tile ran past a wave (Qwen1.5-MoE, 4 bits: 736 tiles on 528 slots)."""
    if ctas == 0:
        return 0, 0
    if shared_tiles == 0:
        return min(ctas, 2 * tiles), 0
    routed = min(2 * tiles, max(1, min(ctas - 1, round(ctas * tiles / (tiles + shared_tiles)))))
    return routed, max(1, min(2 * shared_tiles, ctas - routed))


def down_units(words: int) -> int:
    """m-tiles of a down CTA (cuda/moe.cu `down`): 2 side by side, 2 warps each, when rows are too
    short (< 4 iterations of 8 words) to give 4 warps a share of one tile's columns."""
    return 2 if -(-words // 8) < WARPS else 1


def k_split(ctas: int, words: int, parts: int = WARPS, wave: int | None = None) -> int:
    """CTAs sharing one tile's columns (down only: it adds with atomics), while every one of the
    `parts` warps on a tile keeps at least one 8-word iteration. The lookup kernels: enough CTAs
    to fill the GPU at CTAS_PER_SM an SM. Given `wave` (CTAs resident at once: the popc kernels,
    4-6 an SM), the most that stay within one wave: there a CTA's fixed costs (staging, sums,
    atomics) outweigh a part-empty wave (Mixtral, 4 bits, one token: 110.8 us a layer with one
    CTA a tile, 117.4 with three; docs/decisions/024-one-token-grids.md)."""
    want = -(-CTAS_PER_SM * sm_count() // max(ctas, 1)) if wave is None else wave // max(ctas, 1)
    return max(1, min(want, -(-words // 8) // parts))


def balanced_split(
    words: int, parts: int, like_words: int, like_parts: int, like_split: int
) -> int:
    """The k-split of a group launched beside another (the shared expert beside the routed ones,
    whose rows may be several times longer): enough CTAs a tile that its warps get about the
    iterations of 8 words the other group's warps get, while each keeps at least one."""
    iters, like_iters = -(-words // 8), -(-like_words // 8)
    per_warp = -(-like_iters // (like_parts * like_split))
    return max(1, min(-(-iters // (parts * per_warp)), iters // parts))


@dataclass(frozen=True)
class DownGroup:
    """One group of a decode `down` grid (cuda/moe.cu DOWN_ENTRY): m-tiles a CTA, CTAs a slot's rows
    (one a `units` m-tiles), CTAs sharing a tile's columns."""

    units: int
    ctas: int
    split: int

    @classmethod
    def over(cls, rows: int, units: int, split: int = 1) -> DownGroup:
        return cls(units, -(-rows // (ROWS * units)), split)

    @property
    def parts(self) -> int:  # warps on one m-tile
        return WARPS // self.units

    @property
    def slot_ctas(self) -> int:  # CTAs on one slot's rows: every tile, every split
        return self.ctas * self.split


def down_groups(
    routed: tuple[int, int],
    n_routed: int,
    shared: tuple[int, int] | None,
    wave: int | None,
    split: int | None = None,
    one_wave: bool = True,
) -> tuple[DownGroup, DownGroup | None]:
    """down's grid groups for routed rows (`routed`: rows, words) on `n_routed` slots and the
    shared expert's (or None). The routed split is `split`, or `k_split`'s; the shared expert's
    evens the warps' iterations (`balanced_split`). With `wave` (the popc kernels) and
    `one_wave`, a plan whose two groups overflow the wave takes the first of these that fits:
    the routed tiles two m-tiles a CTA, then smaller routed splits (Qwen1.5-MoE at 4 bits: the
    shared expert's 3 CTAs a tile put 896 CTAs on a wave of 528, 1.7 waves; docs/decisions/
    010-shared-expert-inside.md)."""
    (rows, words), u0 = routed, down_units(routed[1])

    def top(units: int) -> int:  # k_split's routed split at `units` m-tiles a CTA
        g = DownGroup.over(rows, units)
        return k_split(g.ctas * n_routed, words, g.parts, wave)

    def plan(units: int, s: int) -> tuple[DownGroup, DownGroup | None]:
        r = DownGroup.over(rows, units, s)
        if shared is None:
            return r, None
        t = DownGroup.over(shared[0], down_units(shared[1]))
        return r, replace(t, split=balanced_split(shared[1], t.parts, words, r.parts, s))

    first = plan(u0, split if split is not None else top(u0))
    if wave is None or shared is None or split is not None or not one_wave:
        return first
    for units in dict.fromkeys((u0, 2)):  # the default's m-tiles, then two a CTA
        for s in range(top(units), 0, -1):
            r, t = plan(units, s)
            if r.slot_ctas * n_routed + t.slot_ctas <= wave:
                return r, t
    return first


def n_tiles(tokens: int) -> int:
    """The smallest compiled decode tile (in n-tiles of 8 tokens) holding `tokens` a slot."""
    for nt in DECODE_TILES:
        if tokens <= 8 * nt:
            return nt
    raise ValueError(f"{tokens} tokens per slot: decode kernels take at most {DECODE_MAX_TOKENS}")
