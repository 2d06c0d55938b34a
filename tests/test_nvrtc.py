"""The kernels compile under NVRTC, part by part with the options `kernels.part_options` gives
CuPy, for sm_80: the Ampere build the issue asks to compile, which neither this machine nor the
H200 one ever builds (the H200 builds sm_90a at first use). NVRTC is a library, so no GPU is
needed: the dev extra installs NVIDIA's nvidia-cuda-nvrtc wheel.

Each part is a test of its own, marked `early`: conftest runs them before the rest and has
pytest-xdist hand out one test at a time, so that its workers start on the longest items (the
first part, `gate_up_n8` alone, takes two minutes or more on a 2-core machine) and fill in around
them with the short ones; alone, `pytest -n 2 tests/test_nvrtc.py` builds two parts at a time.
A part whose sources (every file of `kernels.CUDA_DIR`), options and NVRTC version hash to a key
that passed before is not compiled again (pytest's cache, `.pytest_cache`; `PWCTL_NVRTC_FRESH=1`
or `--cache-clear` compiles anyway)."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
from pathlib import Path

import pytest

from pwctl.runtime import kernels

# every kernel the launchers name (runtime/moe/, kernels.py): the entry macros must make them all
LAUNCHED = (
    ["decode_prep", "route_prep", "prefill_prep", "token_tiles", "popc_planes"]
    + [f"{k}_{n}" for k in ("gate_up", "down") for n in ("n1", "n2", "n4", "n8")]
    + [f"{k}_{n}" for k in ("gate_up", "down") for n in ("p1", "p1b3", "p1b5", "pn", "pnb3")]
    + [f"{k}_prefill{w}" for k in ("gate_up", "down") for w in ("", "_wg")]
)


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
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"moe.cu", 0, None, None) == 0
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


def _key(nvrtc: ctypes.CDLL, options: tuple[str, ...]) -> str:
    """What a part's result depends on: every source file, the options, NVRTC's version and the
    kernel names the check looks for."""
    h = hashlib.sha256(repr((_version(nvrtc), options, LAUNCHED)).encode())
    for path in sorted(p for p in kernels.CUDA_DIR.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return "pwctl/nvrtc-sm80/" + h.hexdigest()


@pytest.mark.early
@pytest.mark.parametrize("part", range(len(kernels.PARTS)))
def test_part_compiles_for_sm80_with_nvrtc(part, request):
    nvrtc = _nvrtc()
    options = kernels.part_options("sm_80", part)
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    key = _key(nvrtc, options)
    held = None if cache is None or os.environ.get("PWCTL_NVRTC_FRESH") else cache.get(key, None)
    if held is None:
        rc, log, cubin = _compile(nvrtc, kernels.CUDA_SRC.read_bytes(), options)
        assert rc == 0, f"NVRTC failed on part {part} ({rc}):\n{log[-4000:]}"
        held = sorted(name for name in LAUNCHED if b".text." + name.encode() + b"\0" in cubin)
        if cache is not None:
            cache.set(key, held)
    assert held == sorted(kernels.PARTS[part]), f"part {part} holds {held}"


def test_every_launched_kernel_is_in_one_part():
    names = [name for part in kernels.PARTS for name in part]
    assert sorted(names) == sorted(LAUNCHED)  # each once: PART_OF finds it, in one module only


def test_nvrtc_reports_a_broken_source():
    """The harness above fails loudly: a source error gives a non-zero code and NVRTC's log."""
    rc, log, cubin = _compile(_nvrtc(), b"__global__ void k() { undeclared(); }", ("-std=c++17",))
    assert rc != 0 and "undeclared" in log and cubin == b""
