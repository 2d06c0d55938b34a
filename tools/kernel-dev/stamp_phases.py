"""Where each CTA of a decode layer's kernels spends its time (a timing probe). With a cubin built
with the `stamps` probe, thread 0 of every CTA writes the global timer, its SM's clock and its SM
id at each phase of its kernel (`STAMP`, cuda/probes.cuh). This replays the layer's CUDA graph once
and prints, per kernel: its CTAs, when they enter and end (us from the replay's first stamp),
and each phase's median / p90 length (us, from the SM clocks). `routed`: the engine's call (router
in the first launch) instead of given routing; `cold`: L2 flushed (`l2_flush` read) before the
replay, as a step through many layers finds it; `prefill`: the sm_90a prefill kernels (given
routing, eager calls) instead of decode; `waves`: also each kernel's CTAs alive every 2 us (how
full its last wave runs); `popc` / `lookup`: one-token calls on the popc / lookup kernels whatever
the layer's size (DispatchRules.popc_decode); `runs=N`: a one-token gate_up on N persistent CTAs (0:
one a tile; DispatchRules.gate_up_runs); `shares`: a persistent gate_up's CTA ends by the halves of
their shares and by their SMs' halves (is the last CTA's lateness its share, its SM's load, or
neither). Usage (GPU machine):
  python3 tools/kernel-dev/write_program.py /tmp/stamps.cu --probe stamps
  nvcc -arch=sm_90a -std=c++17 -cubin -I cuda -o stamps.cubin /tmp/stamps.cu
  PWCTL_CUBIN=$PWD/stamps.cubin python3 tools/kernel-dev/stamp_phases.py mixtral 1 \
      [routed] [cold] [waves]
  PWCTL_CUBIN=$PWD/stamps.cubin python3 tools/kernel-dev/stamp_phases.py qwen3-moe,mixtral 512 \
      prefill
  (a `--probe stamps_chain` build, `chain`: the popc gate_up's staging chain, stamp by stamp)"""

from __future__ import annotations

import sys

import cupy
import numpy as np
import torch

from pwctl.bench.kernels import capture_graph, decode_calls, l2_flush, routed_call
from pwctl.kernels import build, geometry
from pwctl.runtime.moe.dispatch import DispatchRules

CTAS = 16384  # STAMP_CTAS
KINDS = {  # kind: (name, its phases in the order a CTA passes them); the popc gate_up streams
    # gate and up side by side (decisions/026) and stamps only 3 (thread 0's warp, gate, streamed)
    # and 6 (both summed), which print as 'gate streamed' and 'up summed'
    0: ("gate_up", ((0, "entry"), (1, "waited"), (2, "staged"), (3, "gate streamed"),
                    (4, "gate summed"), (5, "up streamed"), (6, "up summed"), (7, "stored"))),
    1: ("down", ((0, "entry"), (2, "staged"), (1, "waited"), (3, "streamed"), (4, "summed"),
                 (7, "added"))),
    2: ("prep", ((0, "entry"), (1, "logits"), (2, "x laid out"), (3, "last block"),
                 (5, "fenced"), (6, "softmax"), (4, "routed"), (7, "grouped"))),
    3: ("popc_planes", ((0, "entry"), (1, "waited"), (2, "loaded"), (3, "scaled"), (7, "built"))),
}  # fmt: skip
CHAIN = {  # the stamps_chain probe: the popc gate_up's staging chain (`chain`)
    0: ("gate_up", ((0, "entry"), (1, "waited"), (4, "slot's expert"), (5, "widths"),
                    (6, "quotients"), (3, "row pointers"), (2, "staged"), (7, "stored"))),
}  # fmt: skip
_WG = ((0, "entry"), (2, "staged"), (4, "first loads out"), (5, "half-chunk 0"),
       (6, "half-chunk 1"), (3, "streamed"))  # fmt: skip
PREFILL_KINDS = {  # the sm_90a prefill kernels' phases (cuda/prefill_wg.cu prefill_wg_at)
    0: ("gate_up_prefill_wg", (*_WG, (7, "h stored"))),
    1: ("down_prefill_wg", (*_WG, (7, "added"))),
}


def stamps() -> tuple[cupy.ndarray, cupy.ndarray]:
    mod = build.modules()[0]  # PWCTL_CUBIN: one module serves every part
    t = cupy.ndarray((4, CTAS, 16), cupy.uint64, memptr=mod.get_global("pwctl_stamps"))
    sm = cupy.ndarray((4, CTAS), cupy.uint32, memptr=mod.get_global("pwctl_smid"))
    return t, sm


def alive(enter: np.ndarray, end: np.ndarray, step: float = 2.0) -> list[int]:
    """CTAs alive at the middle of each `step`-us bin from 0 to the last end (us)."""
    mids = np.arange(0.0, end.max() + step, step) + step / 2
    return [int(((enter < m) & (end > m)).sum()) for m in mids]


def summary(t: np.ndarray, sm: np.ndarray, kinds: dict = KINDS, waves: bool = False) -> list[str]:
    entered = t[:, :, 0] > 0
    t0 = t[:, :, 0][entered].min()
    lines = []
    for kind, (name, phases) in kinds.items():
        rows = np.flatnonzero(entered[kind])
        if len(rows) == 0:
            continue
        k = t[kind, rows].astype(np.int64)
        timer, clock = k[:, :8] - int(t0), k[:, 8:]
        done = [p for p, _ in phases if (k[:, p] > 0).any()]
        last = done[-1]
        full = k[:, last] > 0  # CTAs that reached the kernel's last phase (not an early exit)
        # the SM clock's rate, from CTAs long enough to see it
        span_t, span_c = k[full, last] - k[full, 0], clock[full, last] - clock[full, 0]
        ok = span_t > 2000
        ghz = float(np.median(span_c[ok] / span_t[ok])) if ok.any() else 1.98
        enter, end = timer[:, 0] / 1e3, timer[full, last] / 1e3
        per_sm = np.bincount(sm[kind, rows]).max()
        lines.append(
            f"  {name}: {len(rows)} CTAs ({full.sum()} to '{dict(phases)[last]}', most on one SM "
            f"{per_sm}); entry {enter.min():.1f} / {np.median(enter):.1f} / {enter.max():.1f}; "
            f"end {end.min():.1f} / {np.median(end):.1f} / {end.max():.1f} us (min / median / max)"
        )
        parts, prev = [], phases[0]
        for p, label in phases[1:]:
            have = full & (k[:, p] > 0) & (k[:, prev[0]] > 0)
            if have.any():
                d = (clock[have, p] - clock[have, prev[0]]) / ghz / 1e3
                parts.append(f"{label} {np.median(d):.2f}/{np.percentile(d, 90):.2f}")
                prev = (p, label)
        lines.append(f"    phases, us median/p90 (clock {ghz:.2f} GHz): " + ", ".join(parts))
        if waves:
            counts = alive(enter[full], end)
            lines.append("    CTAs alive every 2 us: " + " ".join(map(str, counts)))
    return lines


def share_ends(t: np.ndarray, sm: np.ndarray, halves: int) -> list[str]:
    """A persistent gate_up's CTAs (kind 0, all of them routed) by the halves of their shares
    (cuda/lookup.cu RUN: CTA j takes [j H / n, (j + 1) H / n)) and by their SM's total halves: the
    median / max end (us) of each."""
    rows = np.flatnonzero(t[0, :, 0] > 0)
    t0 = t[:, :, 0][t[:, :, 0] > 0].min()
    n, end = len(rows), (t[0, rows, 7].astype(np.int64) - int(t0)) / 1e3
    j = rows.astype(np.int64)
    mine = (j + 1) * halves // n - j * halves // n
    sms = sm[0, rows]
    per_sm = np.bincount(sms, weights=mine).astype(int)
    lines = [f"  gate_up shares: {n} CTAs, {halves} halves"]
    for h in np.unique(mine):
        e = end[mine == h]
        lines.append(
            f"    {h} halves: {len(e)} CTAs, end median {np.median(e):.1f} max {e.max():.1f}"
        )
    sm_end = {s: end[sms == s].max() for s in np.unique(sms)}
    for h in np.unique(per_sm[np.unique(sms)]):
        e = np.array([v for s, v in sm_end.items() if per_sm[s] == h])
        lines.append(
            f"    SMs of {h} halves: {len(e)}, last end median {np.median(e):.1f} max {e.max():.1f}"
        )
    return lines


def main() -> None:
    shapes, tokens = sys.argv[1].split(","), [int(t) for t in sys.argv[2].split(",")]
    routed, cold = "routed" in sys.argv[3:], "cold" in sys.argv[3:]
    prefill, waves = "prefill" in sys.argv[3:], "waves" in sys.argv[3:]
    shares, chain = "shares" in sys.argv[3:], "chain" in sys.argv[3:]
    popc = True if "popc" in sys.argv[3:] else False if "lookup" in sys.argv[3:] else None
    runs = [int(a[5:]) for a in sys.argv[3:] if a.startswith("runs=")]
    rules = DispatchRules(gate_up_runs=runs[0] if runs else None, popc_decode=popc)
    buf, smid = stamps()
    flush = l2_flush()
    for name, T, call in decode_calls(shapes, tokens, path="prefill" if prefill else "decode"):
        call.func.rules = rules  # (the FusedMoE)
        fn = routed_call(call) if routed else call
        run = fn if prefill else capture_graph(fn).replay  # prefill: eager calls
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        for rep in range(2):
            buf.fill(0)
            smid.fill(0)
            cupy.cuda.Device().synchronize()
            if cold:
                flush.sum(dtype=torch.int32)
            run()
            torch.cuda.synchronize()
            how = ("routed" if routed else "given routing") + (", cold L2" if cold else "")
            print(f"{name} T={T} {'prefill, ' if prefill else ''}{how}, replay {rep}:")
            kinds = PREFILL_KINDS if prefill else {**KINDS, **CHAIN} if chain else KINDS
            print("\n".join(summary(buf.get(), smid.get(), kinds, waves)), flush=True)
            moe = call.func
            if shares and not moe.spec.has_shared:  # routed CTAs only (no shared expert's)
                slots = min(moe.spec.num_experts, T * moe.spec.top_k)  # the launch's slot bound
                tiles = 32 * moe.proj[(0, False, "down")].wpad // geometry.ROWS
                print("\n".join(share_ends(buf.get(), smid.get(), 2 * slots * tiles)))


if __name__ == "__main__":
    main()
