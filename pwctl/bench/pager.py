"""Promotions against the copy engine (issue 60): what the pager moves host -> device, measured
against a pinned host-to-device copy of the same bytes on the same stream in the same run.

- whole blocks: every block of one Qwen3-MoE-sized layer (128 experts x gate/up/down, 384
  blocks, ~0.95 GB at 8 bits) promoted from nothing to 8 bits;
- single planes: the same 384 blocks promoted 3 -> 4 bits, one ~200 KB plane each (one plane
  alone is too short to time, so the batch is);
- decode beside a promotion: a decode-like fp16 GEMV (a Mixtral expert, 4 tokens) timed alone
  and while a whole-block promotion runs, in the same run;
- commit CPU: host seconds of the pager's commit that submits each promotion.

GPU seconds of the copies are timed on the copy stream, held by a sleep kernel while the host
enqueues them, so host gaps do not count. Usage (GPU machine):

    python -m pwctl.bench.pager [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from pwctl.bench.planner import synthetic_table
from pwctl.format.pack import write_atomic
from pwctl.runtime.memory.pager import CudaBackend, Pager

GEMV_STEPS = 300
TARGETS = {"whole_block_share": 0.90, "single_plane_share": 0.80, "decode_slowdown": 0.05}


@dataclass(frozen=True)
class PagerFigures:
    slab_bytes: int
    whole_block_bytes: int
    whole_block_gbs: float  # the pager's promotion, GB/s of GPU time
    whole_block_copy_gbs: float  # a pinned copy of the same bytes
    whole_block_commit_ms: float  # host time of the commit that submitted it
    single_planes: int
    single_plane_bytes: int
    single_plane_gbs: float
    single_plane_copy_gbs: float
    single_plane_commit_ms: float
    gemv_us: float  # the decode-like step alone
    gemv_beside_promotion_us: float

    @property
    def whole_block_share(self) -> float:
        return self.whole_block_gbs / self.whole_block_copy_gbs

    @property
    def single_plane_share(self) -> float:
        return self.single_plane_gbs / self.single_plane_copy_gbs

    @property
    def decode_slowdown(self) -> float:
        return self.gemv_beside_promotion_us / self.gemv_us - 1

    def as_dict(self) -> dict[str, float]:
        shares = ("whole_block_share", "single_plane_share", "decode_slowdown")
        return asdict(self) | {k: getattr(self, k) for k in shares} | {"targets": TARGETS}


def _copy_seconds(stream: torch.cuda.Stream, enqueue: Callable[[], object]) -> tuple[float, float]:
    """GPU seconds of the copies `enqueue` puts on `stream`, and its host seconds."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~100 ms: the host enqueues everything meanwhile
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    t0 = time.perf_counter()
    enqueue()
    host = time.perf_counter() - t0
    end.record(stream)
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, host


def _pinned_copy_gbs(stream: torch.cuda.Stream, host: torch.Tensor, nbytes: int) -> float:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def go() -> None:
        with torch.cuda.stream(stream):
            dev.copy_(host[:nbytes], non_blocking=True)

    _copy_seconds(stream, go)  # warm
    return nbytes / _copy_seconds(stream, go)[0] / 1e9


def _gemv_us(steps: int = GEMV_STEPS) -> Callable[[], float]:
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.float16)
    x = torch.randn(4096, 4, device="cuda", dtype=torch.float16)

    def timed() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            w @ x
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps * 1e3

    timed()  # warm
    return timed


def run_pager_bench() -> PagerFigures:
    table = synthetic_table(layers=1, budget=1.0)
    host = torch.empty(table.host_bytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(0x5A)
    backend = CudaBackend(host, table.n_slabs, table.slab_bytes)
    pager, stream, n = Pager(table, backend), backend.stream, table.n_blocks

    def promote(lo: int, hi: int) -> tuple[int, float, float]:
        pager.request(np.full(n, lo))
        pager.settle()
        pager.request(np.full(n, hi))
        gpu, commit = _copy_seconds(stream, pager.commit)
        pager.settle()
        if not (table.width == hi).all():
            raise RuntimeError(f"promotion {lo} -> {hi} bits did not land")
        nbytes = int((table.cost_at[:, hi] - table.cost_at[:, lo]).sum())
        return nbytes, nbytes / gpu / 1e9, commit * 1e3

    whole, whole_gbs, whole_ms = promote(0, 8)
    planes, plane_gbs, plane_ms = promote(3, 4)
    gemv = _gemv_us()
    alone = gemv()
    pager.request(np.zeros(n, int))
    pager.settle()
    pager.request(np.full(n, 8))
    pager.commit()  # ~0.95 GB of copies run beside the GEMVs
    beside = gemv()
    pager.settle()
    return PagerFigures(
        table.slab_bytes, whole, whole_gbs, _pinned_copy_gbs(stream, host, whole), whole_ms,
        n, planes, plane_gbs, _pinned_copy_gbs(stream, host, planes), plane_ms, alone, beside,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the pager benchmark needs a CUDA device")
    f = run_pager_bench()
    print(
        f"{torch.cuda.get_device_name()}; slab {f.slab_bytes} B\n"
        f"whole blocks: {f.whole_block_bytes / 1e6:.0f} MB at {f.whole_block_gbs:.1f} GB/s, "
        f"pinned copy {f.whole_block_copy_gbs:.1f} GB/s ({f.whole_block_share:.0%}), commit "
        f"{f.whole_block_commit_ms:.1f} ms\n"
        f"single planes: {f.single_planes} planes, {f.single_plane_bytes / 1e6:.0f} MB at "
        f"{f.single_plane_gbs:.1f} GB/s, pinned copy {f.single_plane_copy_gbs:.1f} GB/s "
        f"({f.single_plane_share:.0%}), commit {f.single_plane_commit_ms:.1f} ms\n"
        f"decode-like GEMV: {f.gemv_us:.1f} us alone, {f.gemv_beside_promotion_us:.1f} us beside "
        f"a promotion ({f.decode_slowdown:+.1%})"
    )
    if a.json is not None:
        doc = {"device": torch.cuda.get_device_name(), **f.as_dict()}
        write_atomic(a.json, json.dumps(doc, indent=1).encode())


if __name__ == "__main__":
    main()
