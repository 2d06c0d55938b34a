"""One rank of tests/test_expert_parallel.py, run as its own process (as torchrun would start it):
python tests/expert_parallel_worker.py RANK WORLD PORT OUT_DIR MODE [PACK]. MODE "ok": route this
rank's tokens, run the exchange over two MoE layers, save inputs and outputs (safetensors);
"die": rank 1 leaves right after joining, and the others' exchange must fail with a clear error;
"store" / "paged": this rank's prompts (`rank_prompts`) through an engine on this rank's share of
PACK on that expert backend, its experts exchanged, greedy; saves the tokens, the first step's
logits and what the engine holds of the planes. "bench": `run_throughput` on PACK with this
rank's share of each load (`BENCH_LOADS`), saves the rows and the tokens of each request it
served (JSON)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import save_file

from pwctl.errors import PwctlError
from pwctl.runtime.parallel.exchange import ExpertExchange, join
from pwctl.runtime.parallel.launch import leave
from pwctl.runtime.parallel.placement import ExpertPlacement

LAYERS, EXPERTS, TOP_K, HIDDEN, WIDTH = 2, 6, 2, 16, 8
TOKENS = (5, 0, 7, 3)  # rank r routes TOKENS[r] tokens (rank 1 none: it still joins)


def experts() -> list[list[torch.Tensor]]:
    """The same expert weights on every rank (seeded): [layer][expert] -> (gate, up, down)."""
    g = torch.Generator().manual_seed(0)
    shapes = ((WIDTH, HIDDEN), (WIDTH, HIDDEN), (HIDDEN, WIDTH))
    return [[[torch.randn(s, generator=g) for s in shapes] for _ in range(EXPERTS)]
            for _ in range(LAYERS)]  # fmt: skip


def mlp(w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    gate, up, down = w
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's x [T, H] and its softmax-top-k routing (weights, index)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS[rank], HIDDEN, generator=g)
    logits = torch.randn(TOKENS[rank], EXPERTS, generator=g)
    weights, index = torch.softmax(logits, -1).topk(TOP_K, -1)
    return x, weights, index


PROMPTS = ["In the beginning God created", "The quick brown fox", "It is a truth", "0123 4567",
           "Once upon a time"]  # fmt: skip


def rank_prompts(rank: int, world: int) -> list[str]:
    """Uneven work: rank 0 gets most prompts, the last rank one."""
    return PROMPTS[rank::world] if rank < world - 1 else PROMPTS[rank : rank + 1]


def serve(
    pack: str, prompts: list[str], rank_engine=None, experts: str = "store"
) -> dict[str, torch.Tensor]:
    """Greedy tokens (12 a prompt) and the first step's logits on one engine of `pack` (its
    `experts` backend), and what it holds of the planes (`held_planes`); with
    `rank_engine(engine)` the engine is on this rank's share of the pack and its experts are
    exchanged with the others."""
    import torch.distributed as dist

    from pwctl.format.pack import Pack
    from pwctl.policy import parse_policy
    from pwctl.runtime.engine.batcher import BatchConfig
    from pwctl.runtime.engine.engine import Engine
    from pwctl.runtime.engine.scheduler import SamplingParams
    from pwctl.runtime.parallel.rank_pack import rank_pack

    policy = parse_policy("uniform:4")
    opened = Pack(Path(pack))
    if rank_engine is not None:
        opened = rank_pack(opened, dist.get_world_size(), dist.get_rank(), policy)
    engine = Engine(opened, experts=experts)
    batcher = engine.start_batching(policy, None, BatchConfig(max_seqs=2))
    first: list[torch.Tensor] = []
    forward = batcher.runner.forward
    batcher.runner.forward = lambda batch, fed=None: first.append(forward(batch, fed)) or first[-1]
    ids = [engine.tokenizer(p).input_ids for p in prompts]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runner = rank_engine(engine) if rank_engine else engine
    seqs = runner.generate_batch(ids, params)
    tokens = torch.tensor([s.output_ids for s in seqs])
    return {"tokens": tokens, "logits": first[0], **held_planes(engine)}


def held_planes(engine) -> dict[str, torch.Tensor]:
    """Which blocks the engine's pack holds (a rank's share: its own experts'), which the store
    has read, the planes' bytes the memory budget counts and the paged experts' host copy."""
    held = getattr(engine.pack, "held", torch.ones(len(engine.pack.blocks), dtype=torch.bool))
    return {
        "held": torch.as_tensor(held),
        "loaded": torch.tensor(engine.store.loaded_blocks, dtype=torch.int64),
        "plane_bytes": torch.tensor(engine.batcher.metrics()["plane_bytes"]),
        "host_bytes": torch.tensor(0 if engine.paged is None else engine.paged.table.host_bytes),
    }


BENCH_LOADS = ({"batches": (3,)}, {"concurrency": (2,), "requests": 3})  # one run each
BENCH_IN, BENCH_OUT = 24, 6  # tokens a request: prompt (not the warm-up's 16), output


def bench(pack: str, share=None) -> list[tuple[list[dict], dict[str, list[int]]]]:
    """Each of BENCH_LOADS through `run_throughput` on one store engine of `pack`, uniform:4:
    (its rows, each request's output tokens by its prompt ids); with `share(engine)` (a
    RankShare) this rank's share of each, in step with the others."""
    from pwctl.bench.throughput import ThroughputSpec, run_throughput
    from pwctl.build.checkpoint import EVAL_SAMPLE
    from pwctl.format.pack import Pack
    from pwctl.policy import parse_policy
    from pwctl.runtime.engine.batcher import Batcher
    from pwctl.runtime.engine.engine import Engine

    engine = Engine(Pack(Path(pack)))
    ranks = share(engine) if share else None
    out = []
    for load in BENCH_LOADS:
        served = []
        add = Batcher.add

        def recording(self, prompt_ids, params, add=add, served=served):
            seq = add(self, prompt_ids, params)
            served.append(seq)
            return seq

        spec = ThroughputSpec(BENCH_IN, BENCH_OUT, **load)
        with mock.patch.object(Batcher, "add", recording):
            rows = run_throughput(engine, [parse_policy("uniform:4")], spec, EVAL_SAMPLE, None,
                                  ranks)  # fmt: skip
        tokens = {" ".join(map(str, s.prompt_ids)): s.output_ids for s in served
                  if len(s.prompt_ids) == BENCH_IN}  # fmt: skip
        out.append(([r.as_dict() for r in rows], tokens))
    return out


def main() -> None:
    rank, world, port, out, mode = sys.argv[1:6]
    rank, world = int(rank), int(world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    join(rank, world, timeout_s=10)
    run(rank, world, out, mode)
    leave()  # together (a clean clone's run once saw a rank abort at exit without it)


def run(rank: int, world: int, out: str, mode: str) -> None:
    if mode == "bench":
        from pwctl.bench.throughput_ranks import RankShare
        from pwctl.runtime.parallel.ranks import RankEngine

        got = bench(sys.argv[6], lambda engine: RankShare(RankEngine(engine)))
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(got))
        return
    if mode in ("store", "paged"):  # the engines, on that expert backend
        from pwctl.runtime.parallel.ranks import RankEngine

        got = serve(sys.argv[6], rank_prompts(rank, world), RankEngine, mode)  # profile placement
        save_file(got, str(Path(out) / f"rank{rank}.st"))
        return
    if mode == "die" and rank == 1:
        os._exit(0)  # gone without a word: the others must not hang
    load = torch.rand(LAYERS, EXPERTS, generator=torch.Generator().manual_seed(7)).numpy()
    placement = ExpertPlacement.balanced(load, world)
    exchange, w = ExpertExchange(placement), experts()
    x, weights, index = tokens(rank)
    outs = {}
    for layer in range(LAYERS):

        def run(rows: torch.Tensor, experts: torch.Tensor, layer: int = layer) -> torch.Tensor:
            out = torch.zeros_like(rows)
            for e in experts.unique().tolist():
                assert placement.owner[layer, e] == rank, "an expert ran on a rank not its owner"
                mine = experts == e
                out[mine] = mlp(w[layer][e], rows[mine])
            return out

        try:
            outs[f"out{layer}"] = exchange(layer, x, weights, index, run)
        except PwctlError as e:  # a broken gloo group aborts in its destructor: leave now
            print(f"error: {e}", flush=True)
            os._exit(3)
    saved = {"x": x, "weights": weights, "index": index, **outs}
    save_file(saved, str(Path(out) / f"rank{rank}.st"))
    print(f"sent {exchange.stats.sent_bytes} bytes in {exchange.stats.calls} calls", flush=True)


if __name__ == "__main__":
    main()
