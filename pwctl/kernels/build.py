"""The programs the runtime compiles: one a part (`registry.PARTS`), each the geometry's #defines,
its kernels' guards, its family's file (which includes what it needs from cuda/ by -I) and the
entries of its template kernels. CuPy compiles them with NVRTC at first use, side by side, and
caches each on disk by its text, which carries the hash of every source file it includes: a
change to one family's file recompiles that family's parts only.

Development: `PWCTL_CUBIN=FILE` loads one cubin built elsewhere for every part;
`PWCTL_CUDA_DIR=DIR` builds from another folder of sources, a variant of cuda/ (an A/B of
variants in one process: set it, then `launch.reload()`)."""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pwctl.errors import PwctlError
from pwctl.kernels import geometry, registry

_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)


def default_cuda_dir() -> Path:
    """The folder of the kernels' CUDA sources: an installed wheel carries the top-level cuda/ as
    the package data pwctl/cuda (setup.py); a source checkout, or an editable install, has it
    beside pwctl/."""
    package = Path(__file__).resolve().parents[1]
    for folder in (package / "cuda", package.parent / "cuda"):
        if (folder / "common.cuh").is_file():
            return folder
    return package.parent / "cuda"  # missing: `modules` says so


def cuda_dir() -> Path:
    """The sources the builds read: PWCTL_CUDA_DIR (a variant of cuda/, e.g. `git archive main
    cuda | tar -x -C DIR`), or the installed or checked-out ones."""
    variant = os.environ.get("PWCTL_CUDA_DIR")
    return Path(variant).resolve() if variant else default_cuda_dir()


def included(names: Iterable[str], folder: Path) -> list[Path]:
    """The files of `folder` that a program including `names` reads, each after the files it
    includes (so in the order the compiler meets them), each once."""
    seen: list[Path] = []

    def visit(name: str) -> None:
        path = folder / name
        if path in seen:
            return
        if not path.is_file():
            raise PwctlError(f"{path}: kernel source missing (neither installed nor checked out)")
        for inner in _INCLUDE.findall(path.read_text()):
            visit(inner)
        seen.append(path)

    for name in names:
        visit(name)
    return seen


def sources_digest(paths: Iterable[Path]) -> str:
    """sha256 of the files' names and contents: what a program's build depends on besides its
    own text and options."""
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def program_source(
    names: Iterable[str],
    probe: str | None = None,
    variant: registry.Variant = registry.DEFAULT,
) -> str:
    """The program that holds kernels `names` (every one: a whole build, for nvcc): the
    geometry, the variant's #defines its families read, each written-out kernel's guard, the
    family files, each entry. `probe`: a timing probe of cuda/probes.cuh (development builds
    only)."""
    kernels = [registry.BY_NAME[name] for name in names]
    families = [f for f in registry.FAMILIES if any(k.family == f for k in kernels)]
    files = [f"{family}.cu" for family in families]
    digest = sources_digest(included(files, cuda_dir()))
    defines = {k: v for f in families for k, v in variant.defines(f).items()}
    lines = [
        f"// pwctl.kernels.build: {' '.join(k.name for k in kernels)}",
        f"// sources sha256 {digest}",
        *(f"#define {name} {value}" for name, value in geometry.DEFINES.items()),
        *(f"#define {name} {value}" for name, value in defines.items()),
        *([f"#define PWCTL_PROBE PROBE_{probe.upper()}"] if probe else []),
        *(f"#define PWCTL_WANT_{k.name} 1" for k in kernels if not k.entry),
        *(f'#include "{file}"' for file in files),
        *(k.entry_line() for k in kernels if k.entry),
    ]
    return "\n".join(lines) + "\n"


def part_source(part: int, variant: registry.Variant = registry.DEFAULT) -> str:
    """The program of part `part` (`registry.PARTS`) in `variant`'s build (as far as the part's
    family reads it: `registry.part_variant`)."""
    return program_source(registry.PARTS[part], variant=registry.part_variant(part, variant))


def program_options(arch: str) -> tuple[str, ...]:
    """NVRTC's options for a program on `arch` (tests/test_nvrtc.py builds with the same)."""
    return ("-std=c++17", f"--gpu-architecture={arch}", f"-I{cuda_dir()}")


def each_part(build: Callable[[int], object], parts: Iterable[int] | None = None) -> list:
    """build(k) for every part k (or those of `parts`), side by side: a thread a core (NVRTC
    holds no GIL)."""
    todo = list(range(len(registry.PARTS)) if parts is None else parts)
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        return list(pool.map(build, todo))


@functools.cache
def modules(variant: registry.Variant = registry.DEFAULT) -> tuple:
    """One CuPy RawModule a part of `variant`'s build (`part_module`), all compiled on the first
    call, side by side (NVRTC spends nearly all its time on each kernel's own optimization, one
    core a program). With PWCTL_CUBIN, that one cubin serves every part."""
    return tuple(each_part(lambda k: part_module(k, registry.part_variant(k, variant))))


@functools.cache
def part_module(part: int, variant: registry.Variant = registry.DEFAULT):
    """Part `part`'s RawModule in `variant` (as the part reads it: `registry.part_variant`), so a
    part that compiles alike in two variants (the prep launches always) is one module."""
    cupy = _cupy()
    prebuilt = os.environ.get("PWCTL_CUBIN")
    if prebuilt:  # development: a cubin built elsewhere (nvcc) skips NVRTC's minutes on a GPU box
        if variant != registry.DEFAULT:
            raise PwctlError(f"PWCTL_CUBIN holds the default build; the model needs {variant.name}")
        return _prebuilt(prebuilt)
    options, device = program_options(device_arch()), cupy.cuda.runtime.getDevice()
    mod = cupy.RawModule(code=part_source(part, variant), options=options)
    with cupy.cuda.Device(device):  # CuPy compiles with the GIL let go, then loads on `device`
        mod.compile()
    return mod


def _cupy():
    try:
        import cupy
    except ImportError:
        raise PwctlError(
            "the CUDA kernels need CuPy: pip install 'pwctl[cuda13]' (or [cuda12])"
        ) from None
    return cupy


@functools.cache
def _prebuilt(path: str):
    """The one RawModule of PWCTL_CUBIN, for every part."""
    if not Path(path).is_file():
        raise PwctlError(f"PWCTL_CUBIN={path}: no such file")
    return _cupy().RawModule(path=path)


def forget() -> None:
    """Drop every module built or loaded (`launch.reload`)."""
    for cached in (modules, part_module, _prebuilt):
        cached.cache_clear()


def module(launch_name: str):
    """The RawModule that holds the kernel of a launch name (`registry.qualified`: a kernel's
    name, with its variant where its part compiles otherwise than the default's)."""
    name, variant = registry.unqualified(launch_name)
    return part_module(registry.PART_OF[name], variant)


def device_arch() -> str:
    """What NVRTC builds for the current device: sm_90a on Hopper (wgmma: the prefill), sm_XY
    elsewhere."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if has_wgmma() else "")


@functools.cache
def has_wgmma() -> bool:
    """Whether the device runs the sm_90a prefill kernels (warpgroup mma): Hopper (9.0) only;
    other devices take the mma.sync prefill."""
    import torch

    return torch.cuda.get_device_capability() == (9, 0)
