"""Eager decode calls with and without PDL (run twice: as is, then with PWCTL_NO_PDL=1). Per
shape and token count (4 bits), for the engine's routed call and the given-routing call: us a
call back to back with one sync at the end (the GPU's pace while the host keeps up), and the
host's own time a call, submitted while the GPU is held busy. Usage (GPU machine):
  python3 recipes/perf_eager_pdl.py qwen3-moe,qwen-moe,mixtral 1,4
  PWCTL_NO_PDL=1 python3 recipes/perf_eager_pdl.py qwen3-moe,qwen-moe,mixtral 1,4"""

from __future__ import annotations

import os
import sys
import time

import torch

from pwctl.bench.kernels import decode_calls, host_time, routed_call


def submit_time(fn, calls: int = 100) -> float:
    """Seconds of host time a call of `fn`, queued behind ~0.1 s of GPU sleep (nothing waits)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return took


def main() -> None:
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    tag = "no PDL" if os.environ.get("PWCTL_NO_PDL") == "1" else "PDL"
    for name, T, call in decode_calls(shapes, tokens):
        for label, fn in (("given routing", call), ("routed", routed_call(call))):
            gpu = min(host_time(fn) for _ in range(3)) * 1e6
            host = min(submit_time(fn) for _ in range(3)) * 1e6
            print(f"{tag} {name} T={T} {label}: {gpu:.1f} us a call back to back, "
                  f"{host:.1f} us of host time", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
