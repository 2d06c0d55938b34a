"""The share of a pack's blocks at each width that the pagedweight planner gives at each budget
(the plan before any live signal), as `recipes/perf_width_mix.py` takes it. CPU.
Usage:
  python3 recipes/planner_widths.py PACK 0.25,0.3,0.35,0.5
(PACK: a converted pack, e.g. the one `pwctl demo --workdir DIR` leaves in DIR/pack)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from pwctl.policy import parse_policy
from pwctl.runtime.engine import Engine, open_pack


def main() -> None:
    engine = Engine(open_pack(Path(sys.argv[1])))
    for budget in sys.argv[2].split(","):
        engine.set_policy(parse_policy(f"pagedweight:{budget}"))
        widths = np.asarray(engine.store.widths)
        counts = np.bincount(widths)
        mix = ",".join(f"{w}:{c / len(widths):.3f}" for w, c in enumerate(counts) if c)
        print(f"pagedweight:{budget}  mean {widths.mean():.2f} bits  mix {mix}")


if __name__ == "__main__":
    main()
