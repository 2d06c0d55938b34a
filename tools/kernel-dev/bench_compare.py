"""Rows of two `bench --kernels --json` runs set side by side: each row's best time over the
runs of each side (files joined by commas), and the rows the second side runs more than
`--slower` percent slower than the first (exit status 1 if any). What issue 63's split was
checked by: the commit before it against the split, on one machine in one call
(tools/kernel-dev/bench_commits.sh).
Usage: python3 tools/kernel-dev/bench_compare.py A.json[,A2.json] B.json[,B2.json] [--slower 3]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def best_times(paths: str) -> dict[tuple, float]:
    """(shape, width, tokens, path) -> the least time_us of the row over the files."""
    best: dict[tuple, float] = {}
    for path in paths.split(","):
        for row in json.loads(Path(path).read_text())["rows"]:
            key = (row["shape"], row["width"], row["tokens"], row["path"])
            best[key] = min(best.get(key, float("inf")), row["time_us"])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--slower", type=float, default=3.0, help="percent")
    args = parser.parse_args()
    a, b = best_times(args.first), best_times(args.second)
    worse = 0
    for key in sorted(set(a) & set(b)):
        change = 100 * (b[key] / a[key] - 1)
        slower = change > args.slower
        worse += slower
        print(*key, f"{a[key]:9.1f} {b[key]:9.1f} us {change:+6.1f}%", "SLOWER" if slower else "")
    for key in sorted(set(a) ^ set(b)):
        print(*key, "in one run only")
    print(f"{worse} of {len(set(a) & set(b))} rows more than {args.slower}% slower")
    sys.exit(1 if worse else 0)


if __name__ == "__main__":
    main()
