"""The share of a pack's blocks at each width that the pagedweight planner gives at each budget
(the plan before any live signal), as `recipes/perf_width_mix.py` takes it: over every block,
then one mix a projection. CPU.
Usage:
  python3 recipes/planner_widths.py PACK 0.25,0.3,0.35,0.5
(PACK: a converted pack, e.g. the one `pwctl demo --workdir DIR` leaves in DIR/pack)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from pwctl.format.recipe import PROJECTIONS
from pwctl.policy import parse_policy
from pwctl.runtime.engine.engine import Engine, open_pack


def main() -> None:
    engine = Engine(open_pack(Path(sys.argv[1])))
    proj = np.array([b.proj for b in engine.pack.blocks])
    for budget in sys.argv[2].split(","):
        engine.set_policy(parse_policy(f"pagedweight:{budget}"))
        widths = np.asarray(engine.store.widths)
        by_proj = "+".join(f"{p}={mix(widths[proj == p])}" for p in PROJECTIONS)
        print(f"pagedweight:{budget}  mean {widths.mean():.2f} bits  mix {mix(widths)}  {by_proj}")


def mix(widths: np.ndarray) -> str:
    """The widths' histogram as perf_width_mix.py reads it: width:share pairs."""
    counts = np.bincount(widths)
    return ",".join(f"{w}:{c / len(widths):.3f}" for w, c in enumerate(counts) if c)


if __name__ == "__main__":
    main()
