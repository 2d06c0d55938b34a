"""cuda/moe.cu compiles under NVRTC, part by part with the options `kernels.modules()` gives CuPy,
for sm_80: the Ampere build the issue asks to compile, which neither this machine nor the H200 one
ever builds (the H200 builds sm_90a at first use). NVRTC is a library, so no GPU is needed: the dev
extra installs NVIDIA's nvidia-cuda-nvrtc wheel. The parts build side by side, as `modules()`
builds them (ctypes lets go of the GIL in the call)."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest

from pwctl.runtime import kernels

# every kernel the launchers name (fused_moe.py, kernels.py): the entry macros must make them all
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


def test_moe_cu_compiles_for_sm80_with_nvrtc():
    nvrtc = _nvrtc()
    source = kernels.CUDA_SRC.read_bytes()

    def build(part: int) -> tuple[int, str, bytes]:
        return _compile(nvrtc, source, kernels.part_options("sm_80", part))

    for part, (rc, log, cubin) in enumerate(kernels.each_part(build)):
        assert rc == 0, f"NVRTC failed on part {part} ({rc}):\n{log[-4000:]}"
        held = sorted(name for name in LAUNCHED if b".text." + name.encode() + b"\0" in cubin)
        assert held == sorted(kernels.PARTS[part]), f"part {part} holds {held}"


def test_every_launched_kernel_is_in_one_part():
    names = [name for part in kernels.PARTS for name in part]
    assert sorted(names) == sorted(LAUNCHED)  # each once: PART_OF finds it, in one module only


def test_nvrtc_reports_a_broken_source():
    """The harness above fails loudly: a source error gives a non-zero code and NVRTC's log."""
    rc, log, cubin = _compile(_nvrtc(), b"__global__ void k() { undeclared(); }", ("-std=c++17",))
    assert rc != 0 and "undeclared" in log and cubin == b""
