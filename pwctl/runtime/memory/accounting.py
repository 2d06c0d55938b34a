"""The one owner of device-memory accounting (`--memory-budget` itself is parsed once, by
`pwctl.policy.BudgetArg`): what the fixed part of a serving engine takes, and how the
process's real peak is read.

    --memory-budget = fixed + planes + KV blocks          (the CUDA context is outside it)
    fixed           = non-expert weights + the workspace of the largest step the scheduler forms

The workspace is sized from shapes, before anything runs, so the slab arena (planes and KV
blocks) can take the rest at start-up:

- a decode step of S rows (the largest graph bucket) over L cache rows (the longest sequence
  the KV cache can hold, rounded up to the decode graphs' power-of-two bucket) gathers each
  layer's keys and values for every row (`attention._attend_decode`): 2 x S x L rows, plus the
  copies SDPA makes of them and the mask; the logits of S rows;
- a prefill chunk of `max_batch_tokens` tokens: its hidden-state temporaries (norms, q/k/v,
  the MoE's gathered pairs and intermediate) and, per layer, the keys and values it attends to;
- the sampler's probabilities (S x vocab, fp32, a few copies).

The decode gather dominates at long contexts (Qwen1.5-MoE-shaped, 32 rows x 4096 rows: 2.1 GB):
that is the price of attending through a gather rather than a paged-attention kernel, and the
budget says so rather than hiding it. On CUDA the engine confirms the formula at start-up: it
runs the largest eager step and decode graph once (`ModelRunner.largest_eager_step`,
`largest_graph_step`, measured by `step_bytes`) and, if
that took more than the formula's step, sizes the arena from the measured figure instead (and
logs by how much the formula fell short). `DevicePeak.read` is what every check compares with the
budget: `torch.cuda.max_memory_reserved()` (the caching allocator's high-water mark, the
arena and graph pools included) plus CuPy's pool, with NVML's per-process figure beside it;
`cap_allocator` holds torch's part to the budget (the allocator gives free cached pages back
before it passes it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pwctl.runtime.memory.kv_cache import KVLayout

SLACK = 0.02  # a run's peak may pass its budget by this fraction (allocator rounding)
DECODE_COPIES = 4  # decode attention: gathered K and V, and SDPA's copies of them
PREFILL_HIDDEN = 24  # hidden-sized temporaries a prefill token holds at once in a layer
SAMPLER_COPIES = 4  # logits, probabilities, noise, sorted top: vocab-sized rows at once


@dataclass(frozen=True)
class StepShape:
    """The largest step the scheduler can form: what the workspace is sized for."""

    max_seqs: int
    max_batch_tokens: int
    max_len: int  # the longest sequence the KV cache can hold (tokens)
    block_size: int


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int  # one expert's (or the dense MLP's, if wider)
    top_k: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    elem: int  # bytes of the serving dtype

    @classmethod
    def of(cls, config: Any, spec: dict, dtype: torch.dtype) -> ModelShape:
        kv = KVLayout.from_config(config, dtype)  # its head counts, as the KV cache reads them
        dense = getattr(config, "intermediate_size", 0) or 0
        return cls(
            hidden=config.hidden_size,
            intermediate=max(int(spec["intermediate"]), int(dense)),
            top_k=int(spec["top_k"]),
            q_heads=config.num_attention_heads,
            kv_heads=kv.kv_heads,
            head_dim=kv.head_dim,
            vocab=config.vocab_size,
            elem=kv.elem_bytes,
        )


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def workspace(m: ModelShape, s: StepShape, graphs: bool = False) -> dict[str, int]:
    """Bytes of each transient a step holds at its peak (see the module docstring). With
    decode graphs, the largest decode step's temporaries live in the graphs' private pool,
    apart from the eager steps' (prefill chunks, and the decodes that run beside them)."""
    kv_row = m.kv_heads * m.head_dim * m.elem  # keys (or values) of one token in one layer
    rows = s.max_seqs  # a decode graph's bucket never passes max_seqs; eager decode is S rows
    blocks = max(4, _pow2(-(-s.max_len // s.block_size)))  # decode_graphs.MIN_BLOCKS
    L = blocks * s.block_size
    decode = DECODE_COPIES * rows * L * kv_row + rows * L  # gathers and the mask
    decode += rows * m.q_heads * L * 4  # SDPA's scores, where it materialises them
    T = s.max_batch_tokens
    prefill = T * m.hidden * PREFILL_HIDDEN * m.elem
    prefill += T * m.top_k * m.intermediate * 3 * 4  # the MoE's pairs: gate, up, act (fp32)
    prefill += DECODE_COPIES * s.max_len * kv_row  # a chunk attends to its sequence's cache
    prefill += m.q_heads * T * min(s.max_len, T + s.max_len) * 4  # math SDPA's scores
    logits = rows * m.vocab * 4 * SAMPLER_COPIES
    parts = {"step": max(decode, prefill)}
    if graphs:
        parts["decode_graph_pool"] = decode
    return parts | {"logits_and_sampler": logits}


@dataclass(frozen=True)
class FixedPart:
    """Device bytes outside planes and KV blocks, by part (`total` is their sum). `measured`:
    what the largest eager step took on the device at start-up (`step_bytes`), None until
    measured; the "step" part is the larger of it and the formula's."""

    weights: int
    parts: dict[str, int] = field(default_factory=dict)
    measured: int | None = None

    def confirmed(self, measured: int) -> FixedPart:
        """This part with the largest step's workspace and the decode graphs' pool together no
        smaller than `measured` (what the eager step and the largest graph's capture took)."""
        parts = dict(self.parts)
        counted = parts.get("step", 0) + parts.get("decode_graph_pool", 0)
        parts["step"] = parts.get("step", 0) + max(0, int(measured) - counted)
        return FixedPart(self.weights, parts, int(measured))

    @property
    def workspace(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        return self.weights + self.workspace


def fixed_part(
    model: torch.nn.Module,
    spec: dict,
    dtype: torch.dtype,
    step: StepShape,
    graphs: bool = False,
) -> FixedPart:
    """Non-expert weights and the workspace of `step` (`graphs`: decode steps replay CUDA
    graphs, whose pool is apart from the eager steps')."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    m = ModelShape.of(model.config, spec, dtype)
    return FixedPart(weights, workspace(m, step, graphs))


@dataclass(frozen=True)
class DevicePeak:
    """The process's peak device memory since the last reset (bytes)."""

    reserved: int  # torch.cuda.max_memory_reserved
    cupy_pool: int  # CuPy's default pool, held now (it only grows unless freed)
    nvml: int | None  # NVML's figure for this process (context included), a cross-check

    @property
    def total(self) -> int:
        return self.reserved + self.cupy_pool

    @classmethod
    def read(cls, device: str) -> DevicePeak:
        if not device.startswith("cuda"):
            return cls(0, 0, None)
        dev = torch.device(device)
        return cls(int(torch.cuda.max_memory_reserved(dev)), _cupy_pool_bytes(), _nvml_bytes(dev))

    @staticmethod
    def reset(device: str) -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # reserved then starts from what is live, not a past run
            torch.cuda.reset_peak_memory_stats(torch.device(device))


def measures_steps(device: str) -> bool:
    """Whether `step_bytes` can measure on `device` (the CPU's RSS holds caches a GPU would not:
    there the formula stands alone)."""
    return device.startswith("cuda")


def step_bytes(device: str, eager: Callable[[], object], graphs: Callable[[], object]) -> int:
    """Device bytes the largest step takes above what is live when it starts: `eager()`'s
    allocated high-water mark past what was allocated before, plus what `graphs()` (the decode
    graphs' capture) keeps: the reserve of their private pools and the bytes it leaves
    allocated in the default pool; plus the growth of CuPy's pool. Allocated bytes, not
    reserved ones: how the caching allocator's free pages lie depends on what ran before, so
    reserved growth differed between processes measuring one step (an H100, 2026-12-06:
    `serving_budget --measure` and the engine after it, one 20 MiB segment apart); the
    reserved slack past it is the allocator cap's to give back (`cap_allocator`). Resets
    torch's peak statistics (the engine calls it at start-up, before any run is measured)."""
    dev = torch.device(device)
    DevicePeak.reset(device)
    before, pool = torch.cuda.memory_allocated(dev), _cupy_pool_bytes()
    eager()
    torch.cuda.synchronize(dev)
    transient = torch.cuda.max_memory_allocated(dev) - before
    kept_before, private_before = _pool_bytes(device)
    graphs()
    torch.cuda.synchronize(dev)
    kept, private = _pool_bytes(device)
    graph = max(0, kept - kept_before) + max(0, private - private_before)
    return int(max(0, transient) + graph + max(0, _cupy_pool_bytes() - pool))


def cap_allocator(device: str, budget: int) -> int:
    """Hold torch's caching allocator to `budget` plus the peak check's slack, less what
    CuPy's pool holds; the cap in bytes (0 off CUDA). Past the cap the allocator gives its
    free cached pages back and tries again before it fails, so the pages a step's temporaries
    left free (whose layout depends on the steps before) do not add up past the budget: on an
    H100 (2026-12-06) the reserved mark rose ~200 MB past start-up in 65-80 MB rises while the
    allocated bytes stayed under the budget. What is allocated is the engine's to keep under
    the budget (weights, arena, the measured step); only a step larger than measured reaches
    the cap's error."""
    if not device.startswith("cuda"):
        return 0
    cap = int(budget * (1 + SLACK)) - _cupy_pool_bytes()
    total = device_capacity(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(cap, 0) / total), _index(device))
    return cap


def release_allocator_cap(device: str) -> None:
    """torch's caching allocator back to the whole device: a new engine's weights are not
    under the last engine's budget, nor is work after serving (tests, bench's next policy)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0, _index(device))


def _index(device: str) -> int:
    """The CUDA device index of `device` ("cuda" is the current device: the fraction's setter
    takes no index-less device)."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _pool_bytes(device: str) -> tuple[int, int]:
    """Bytes allocated in the default pool, and reserved by CUDA graphs' private pools."""
    default = private = 0
    for _, pool, reserved, allocated in _segments(device):
        if pool == "default":
            default += allocated
        else:
            private += reserved
    return default, private


def reserved_where(device: str) -> list[dict[str, object]]:
    """Where torch's reserved bytes sit now, by stream and pool (the default pool, or a CUDA
    graph's private pool): reserved and allocated MB and segments each. The peak check counts
    reserved bytes; where they pass the allocated ones by more than a segment, this says whose
    they are."""
    rows: dict[tuple[int, str], dict[str, float]] = {}
    for stream, pool, reserved, allocated in _segments(device):
        row = rows.setdefault(
            (stream, pool), dict.fromkeys(("reserved_mb", "allocated_mb", "segments"), 0.0)
        )
        row["reserved_mb"] += reserved / 1e6
        row["allocated_mb"] += allocated / 1e6
        row["segments"] += 1
    return [
        {"stream": stream, "pool": pool, **{k: round(v, 1) for k, v in row.items()}}
        for (stream, pool), row in sorted(rows.items())
    ]


def _segments(device: str) -> Iterator[tuple[int, str, int, int]]:
    """torch's segments on `device`: stream, pool ("default" or "graph (a, b)"), reserved and
    allocated bytes."""
    index = _index(device)
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", 0) != index:
            continue
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        name = "default" if pool == (0, 0) else f"graph {pool}"
        yield int(seg.get("stream", 0)), name, int(seg["total_size"]), int(seg["allocated_size"])


PROBE_SEED = 0


def probe_ids(vocab: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Token ids for a step run to be measured (`step_bytes`): random, from a fixed seed. The
    ids pick the experts and the experts' group sizes pick the allocations, so with unseeded
    ids two processes measuring one step need not agree. They did not on an H100 (2026-12-06):
    `serving_budget --measure` 348 MB, the engine after it 369 MB (one 20 MiB segment); the
    engine then held 21 MB less KV than the calculator's budget for 4 sequences and preempted
    40 times. A fixed seed removes this cause of disagreement."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(vocab, shape, generator=gen)


def configure_allocator() -> None:
    """Expandable segments for torch's CUDA caching allocator, unless the user set its options
    (PYTORCH_CUDA_ALLOC_CONF). Serving asks for temporaries whose size grows step by step (a
    prefill chunk's attention over a longer past, a decode group of one more sequence); with
    fixed segments each new size took a new segment and kept the old ones cached, and on an
    H100 the reserved high-water mark grew to 49.8 GB under a 9.8 GB budget (32 concurrent
    2048/256 requests) while 10 GB were live. An expandable segment maps more pages into one
    range instead, so freed memory serves the next, larger request."""
    import os

    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    # torch 2.11 moved the setter (the old one warns); both take the PYTORCH_CUDA_ALLOC_CONF text
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")


def device_capacity(device: str) -> int:
    """Bytes the device has in all: the GPU's memory, or on the CPU the machine's RAM."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[1])
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def over_budget(peak: int, budget: int) -> bool:
    return peak > budget * (1 + SLACK)


def _cupy_pool_bytes() -> int:
    try:
        import cupy
    except ImportError:
        return 0
    return int(cupy.get_default_memory_pool().total_bytes())


def _nvml_bytes(dev: torch.device) -> int | None:
    """This process's device memory as NVML sees it, or None where NVML is not there."""
    try:
        import os

        import pynvml

        pynvml.nvmlInit()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory or 0) or None
    except Exception:  # no pynvml, no driver access, a container that hides pids
        return None
    return None
