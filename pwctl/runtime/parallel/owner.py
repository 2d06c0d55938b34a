"""A rank that only serves its experts to the others, holding their planes alone (`rank_pack`),
started by `launch.ranks` for generate:
python -m pwctl.runtime.parallel.owner PACK POLICY MAX_BITS MEMORY_BUDGET DEVICE ("-": none),
with torchrun's environment (DEVICE: cpu or cuda, as rank 0 was asked; this rank takes its own
GPU). Once no rank has work it hands rank 0 its metrics (rank 0 gathers every rank's at that
point: `gather_rank_metrics`)."""

from __future__ import annotations

from pathlib import Path

from pwctl.errors import PwctlError
from pwctl.runtime.parallel.launch import rank_entry


def main(argv: list[str]) -> int:
    from pwctl.policy import parse_policy
    from pwctl.runtime.engine.batcher import BatchConfig
    from pwctl.runtime.engine.engine import Engine, experts_for, open_pack, serving_dtype
    from pwctl.runtime.engine.scheduler import SamplingParams
    from pwctl.runtime.parallel.exchange import join
    from pwctl.runtime.parallel.launch import TIMEOUT_S, leave, rank_device, torchrun_rank
    from pwctl.runtime.parallel.rank_metrics import gather_rank_metrics
    from pwctl.runtime.parallel.rank_pack import rank_pack
    from pwctl.runtime.parallel.ranks import RankEngine

    pack, policy = Path(argv[0]), parse_policy(argv[1])
    max_bits = None if argv[2] == "-" else int(argv[2])
    budget = None if argv[3] == "-" else argv[3]
    launched = torchrun_rank()
    if launched is None:
        raise PwctlError("an owner rank needs RANK and WORLD_SIZE (launch.ranks sets them)")
    device = rank_device(argv[4], launched[1])
    join(*launched, TIMEOUT_S, device)
    experts = experts_for(policy, device)  # as rank 0 chose: the same backend and dtype
    share = rank_pack(open_pack(pack), launched[1], launched[0], policy)
    engine = Engine(share, device, serving_dtype(device, experts), experts, max_bits)
    batcher = engine.start_batching(policy, budget, BatchConfig())
    ranks = RankEngine(engine)
    ranks.generate_batch([], SamplingParams())  # serve until no rank has work
    gather_rank_metrics(batcher, ranks.exchange.stats)
    leave()
    return 0


if __name__ == "__main__":
    rank_entry(main)
