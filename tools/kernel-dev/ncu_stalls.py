"""Summarize `ncu -i REPORT --page source --csv --print-source sass`: stall reasons over all
warp-state samples, then the most-sampled instructions with their three largest reasons.
Usage: python3 tools/kernel-dev/ncu_stalls.py source.csv [top]"""

from __future__ import annotations

import csv
import sys


def main() -> None:
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.reader(f))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    at = next(i for i, r in enumerate(rows) if any("Warp Stall Sampling (All" in c for c in r))
    head = rows[at]
    col = {c: i for i, c in enumerate(head)}
    samples = next(i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All"))
    stalls = [(i, c[len("stall_") :]) for i, c in enumerate(head) if c.startswith("stall_")]
    data = []
    for r in rows[at + 1 :]:
        try:
            data.append((float(r[samples] or 0), r))
        except (ValueError, IndexError):
            continue
    total = sum(s for s, _ in data) or 1.0
    by = {c: sum(float(r[i] or 0) for _, r in data) for i, c in stalls}
    print("samples", total)
    largest = sorted(by.items(), key=lambda x: -x[1])[:10]
    print(", ".join(f"{c}={100 * v / total:.1f}%" for c, v in largest))
    src, addr = col.get("Source", 1), col.get("Address", 0)
    for s, r in sorted(data, key=lambda x: -x[0])[:top]:
        reasons = sorted(((float(r[i] or 0), c) for i, c in stalls), reverse=True)[:3]
        cells = " ".join(f"{c}={v:.0f}" for v, c in reasons if v)
        print(f"{100 * s / total:5.2f}% {r[addr]:>8} {r[src][:60]:60} {cells}")


if __name__ == "__main__":
    main()
