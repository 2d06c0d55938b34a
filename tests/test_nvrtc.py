"""The kernels compile under NVRTC, part by part, each part's program (`build.part_source`) with the
options `build.program_options` gives CuPy, for sm_80: the Ampere build the issue asks to compile,
which neither this machine nor the H200 one ever builds (the H200 builds sm_90a at first use).
NVRTC is a library, so no GPU is needed: the dev extra installs NVIDIA's nvidia-cuda-nvrtc wheel.

Each part is a test of its own, marked `early`: conftest runs them before the rest and has
pytest-xdist hand out one test at a time, so that its workers start on the longest items (the
first part, `gate_up_n8` alone, takes two minutes or more on a 2-core machine) and fill in around
them with the short ones; alone, `pytest -n 2 tests/test_nvrtc.py` builds two parts at a time.
A part whose program (which carries the hash of every source file it includes), options and
NVRTC version hash to a key that passed before is not compiled again (pytest's cache,
`.pytest_cache`; `PWCTL_NVRTC_FRESH=1` or `--cache-clear` compiles anyway): a change to one
family's file recompiles that family's parts only."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
from pathlib import Path

import pytest

from pwctl.kernels import build, geometry, registry


def _nvrtc() -> ctypes.CDLL:
    """libnvrtc from the nvidia-cuda-nvrtc wheel (its builtins library loaded first, globally, for
    libnvrtc's own dlopen of it to find)."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        lib = Path(root) / "cu13" / "lib"
        builtins = sorted(p for p in lib.glob("libnvrtc-builtins.so.*") if ".alt." not in p.name)
        if (lib / "libnvrtc.so.13").exists() and builtins:
            ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(lib / "libnvrtc.so.13"))
    pytest.skip("no libnvrtc: the dev extra installs nvidia-cuda-nvrtc on Linux")


def _compile(nvrtc: ctypes.CDLL, source: bytes, options: tuple[str, ...]) -> tuple[int, str, bytes]:
    """(NVRTC's result code, its log, the cubin)."""
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"part.cu", 0, None, None) == 0
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        rc = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        cubin = b""
        if rc == 0:
            nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            out = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetCUBIN(prog, out)
            cubin = out.raw
        return rc, log.value.decode(errors="replace"), cubin
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def _version(nvrtc: ctypes.CDLL) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    assert nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
    return f"{major.value}.{minor.value}"


def _key(nvrtc: ctypes.CDLL, source: str, options: tuple[str, ...]) -> str:
    """What a part's result depends on: its program (the sources' hash in it), the options less
    the checkout's path, NVRTC's version and every kernel name the check looks for."""
    options = tuple(o for o in options if not o.startswith("-I"))
    names = sorted(registry.BY_NAME)
    return (
        "pwctl/nvrtc-sm80/"
        + hashlib.sha256(repr((_version(nvrtc), options, names, source)).encode()).hexdigest()
    )


def _kernels_in(cubin: bytes) -> list[str]:
    """The registry's kernels whose code the cubin holds."""
    return sorted(name for name in registry.BY_NAME if b".text." + name.encode() + b"\0" in cubin)


def _variant_parts() -> list[int]:
    """The parts a variant other than the default compiles here: one a family, its last (a
    family's parts go from its longest compile to its shortest) among those that hold a gate_up
    and a down kernel, since the variant's code is macros both take (cuda/planes.cuh). Every part
    of every variant is 33 compiles against the default's 12, which alone take ~430 s of CPU
    with nothing cached (docs/PERF.md "NVRTC compile"): on the 2-core machine that is ~400 s more
    of a clean clone's `make test`, past its 10 minutes (with these 21: `.ci/run` 494 s in all,
    2026-12-06). The device compiles a variant's every part at first use, and PWCTL_NVRTC_ALL=1
    does here."""
    if os.environ.get("PWCTL_NVRTC_ALL"):
        return list(range(len(registry.PARTS)))
    parts = range(len(registry.PARTS))
    chosen: dict[str, int] = {}
    for part in parts:
        family = registry.part_family(part)
        if _both(part) or not any(_both(q) for q in parts if registry.part_family(q) == family):
            chosen[family] = part
    return sorted(chosen.values())


def _both(part: int) -> bool:
    """Whether part `part` holds a gate_up and a down kernel."""
    names = registry.PARTS[part]
    return any(n.startswith("gate_up") for n in names) and any(n.startswith("down") for n in names)


# Every part of the default variant, and `_variant_parts` of every other a recipe asks for
# (registry.VARIANTS); each once: a part that compiles alike in two variants
# (`registry.part_variant`: the prep launches always) is the first's.
_PARTS = list(
    dict.fromkeys(
        (part, registry.part_variant(part, v))
        for v in registry.VARIANTS
        for part in (range(len(registry.PARTS)) if v == registry.DEFAULT else _variant_parts())
    )
)


@pytest.mark.early
@pytest.mark.parametrize(
    "part, variant", _PARTS, ids=[f"{p}-{v.name or 'default'}" for p, v in _PARTS]
)
def test_part_compiles_for_sm80_with_nvrtc(part, variant, request):
    nvrtc = _nvrtc()
    source, options = build.part_source(part, variant), build.program_options("sm_80")
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    key = _key(nvrtc, source, options)
    held = None if cache is None or os.environ.get("PWCTL_NVRTC_FRESH") else cache.get(key, None)
    if held is None:
        rc, log, cubin = _compile(nvrtc, source.encode(), options)
        assert rc == 0, f"NVRTC failed on part {part} ({rc}):\n{log[-4000:]}"
        held = _kernels_in(cubin)
        if cache is not None:
            cache.set(key, held)
    assert held == sorted(registry.PARTS[part]), f"part {part} holds {held}"


def test_every_kernel_is_in_one_part_of_its_family():
    names = [name for part in registry.PARTS for name in part]
    assert sorted(names) == sorted(registry.BY_NAME)  # each once: PART_OF finds it in one module
    assert all(registry.PARTS)  # no part is empty
    for part in range(len(registry.PARTS)):
        assert registry.part_family(part) in registry.FAMILIES  # one family a part


def test_the_registry_has_a_decode_kernel_for_every_build_the_launcher_names():
    """The decode kernels the launchers name (runtime/moe/: `gate_up_<build>`, `down_<build>`): the
    lookup's for every tile, the popc builds; and each family file holds its written-out
    kernels (the entries are made by the program)."""
    builds = [f"n{nt}" for nt in geometry.DECODE_TILES] + ["p1", "p1b3", "p1b5", "pn", "pnb3"]
    for b in builds:
        for kind in ("gate_up", "down"):
            assert registry.BY_NAME[f"{kind}_{b}"].entry, (kind, b)
    for k in registry.KERNELS:
        text = (build.cuda_dir() / f"{k.family}.cu").read_text()
        assert (f"#if WANT({k.name})" in text) != bool(k.entry), k.name


def test_a_program_reads_only_its_familys_sources():
    """A part's program includes its family's file, which includes what it needs: the prep
    launches read neither the decode nor the prefill sources."""
    prep = registry.PART_OF["decode_prep"]
    files = {p.name for p in build.included(["prep.cu"], build.cuda_dir())}
    assert files == {"common.cuh", "probes.cuh", "pieces.cuh", "prep.cu"}
    assert '#include "prep.cu"' in build.part_source(prep)
    assert build.sources_digest(build.included(["prep.cu"], build.cuda_dir())) in build.part_source(
        prep
    )


def test_probes_take_one_switch_that_no_part_sets():
    """The runtime's programs name no probe; a development build names one (the stamps here: the
    kernel then writes its phases), and a name cuda/probes.cuh does not know stops the compile."""
    assert not any("PWCTL_PROBE" in build.part_source(k) for k in range(len(registry.PARTS)))
    nvrtc, options = _nvrtc(), build.program_options("sm_80")
    stamped = build.program_source(["route_prep"], probe="stamps").encode()
    rc, log, cubin = _compile(nvrtc, stamped, options)
    assert rc == 0 and b"pwctl_stamps" in cubin, log[-2000:]
    rc, log, _ = _compile(nvrtc, build.program_source(["route_prep"], probe="x").encode(), options)
    assert rc != 0 and "names no probe" in log


def test_nvrtc_reports_a_broken_source():
    """The harness above fails loudly: a source error gives a non-zero code and NVRTC's log."""
    rc, log, cubin = _compile(_nvrtc(), b"__global__ void k() { undeclared(); }", ("-std=c++17",))
    assert rc != 0 and "undeclared" in log and cubin == b""
