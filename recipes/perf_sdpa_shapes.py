"""What a decode step's attention costs when its cache length is new to the process: eager decode
attends over L cache rows with L one longer every step, so each step may be a shape SDPA has not
seen. Times SDPA calls over L = 513..640 (first pass: every L new; second pass: the same L again)
for Mixtral's heads (32 query, 8 KV, head 128, fp16), one sequence without a mask and four with
a boolean length mask (the engine's two eager decode forms), under torch's default backend choice
and with the cuDNN backend left out. Then, per backend, what a decode graph's attention costs
(`graphs`): the first eager call of a new shape, the capture of a graph of 8 calls (8 layers)
and its replay, for the fixed shapes a decode graph has (S rows, L cache rows, the boolean
length mask of `DecodeBatch`). Usage (GPU machine): python3 recipes/perf_sdpa_shapes.py"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ALL = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
       SDPBackend.MATH]  # fmt: skip


def one_pass(S: int, masked: bool, lengths: range) -> float:
    """Mean ms a call over `lengths`, synced each call."""
    dev, dt = "cuda", torch.float16
    total = 0.0
    for L in lengths:
        q = torch.randn(S, 32, 1, 128, device=dev, dtype=dt)
        k, v = (torch.randn(S, 8, L, 128, device=dev, dtype=dt) for _ in range(2))
        mask = None
        if masked:
            mask = torch.arange(L, device=dev)[None, :] < L - torch.arange(S, device=dev)[:, None]
            mask = mask[:, None, None, :]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.cuda.synchronize()
        total += time.perf_counter() - t0
    return total / len(lengths) * 1e3


def _graph_case(S: int, L: int, backends: list[SDPBackend]) -> tuple[float, float, float]:
    """(first eager call ms, capture ms, replay ms a call) of S masked one-query rows over L."""
    dev, dt = "cuda", torch.float16
    q = torch.randn(S, 32, 1, 128, device=dev, dtype=dt)
    k, v = (torch.randn(S, 8, L, 128, device=dev, dtype=dt) for _ in range(2))
    lengths = torch.randint(L // 2, L + 1, (S,), device=dev)
    mask = (torch.arange(L, device=dev)[None, :] < lengths[:, None])[:, None, None, :]

    def call():
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(graph):
        for _ in range(8):
            call()
    torch.cuda.synchronize()
    capture = time.perf_counter() - t0
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return first * 1e3, capture * 1e3, start.elapsed_time(end) / 20 / 8


def graphs() -> None:
    for name, backends in (("cudnn", ALL[:1]), ("efficient", ALL[2:3]), ("math", ALL[3:])):
        for S in (1, 4, 16):
            for L in (64, 512, 2048):
                first, capture, replay = _graph_case(S, L, backends)
                print(f"graph {name:9s} S={S:2d} L={L:4d}: first call {first:7.2f} ms, capture of"
                      f" 8 {capture:7.2f} ms, replay {replay * 1e3:6.1f} us a call")  # fmt: skip


def main() -> None:
    lengths = range(513, 641)
    for name, ctx in (("default", nullcontext), ("no cudnn", lambda: sdpa_kernel(ALL[1:]))):
        with ctx():
            for S, masked in ((1, False), (4, True)):
                first = one_pass(S, masked, lengths)
                second = one_pass(S, masked, lengths)
                print(f"{name:9s} S={S} mask={masked!s:5s}: {first:.3f} ms a call with new L,"
                      f" {second:.3f} ms the second time")  # fmt: skip
    graphs()


if __name__ == "__main__":
    main()
