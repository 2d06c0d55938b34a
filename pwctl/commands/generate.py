"""pwctl generate PACK --prompt TEXT: one greedy generation on the serving engine's batched path."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pwctl.commands import checks
from pwctl.commands.checks import Verify
from pwctl.commands.common import (
    CudaGraphs,
    Device,
    JsonOut,
    MaxBits,
    MemoryBudget,
    PolicyOption,
    console,
    err_console,
    handles_errors,
    policy_or_auto,
    write_json,
)
from pwctl.device import parse_device
from pwctl.errors import PwctlError
from pwctl.policy import BudgetArg


@handles_errors
def run(
    pack: Annotated[Path, typer.Argument(help="pack folder")],
    prompt: Annotated[str, typer.Option(help="prompt text")],
    max_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 32,
    policy: PolicyOption = "auto",
    memory_budget: MemoryBudget = None,
    max_bits: MaxBits = None,
    cuda_graphs: CudaGraphs = True,
    verify: Verify = True,
    device: Device = "auto",
    expert_parallel: Annotated[
        int,
        typer.Option(
            help="ranks that share the experts (each runs its owned experts for all; started "
            "here, or by torchrun): gloo on the CPU, NCCL on CUDA (a GPU a rank)"
        ),
    ] = 1,
    json: JsonOut = None,
) -> None:
    """Greedy-decode a continuation of PROMPT with the experts at POLICY's widths."""
    pol = policy_or_auto(policy)
    checks.at_least("--max-tokens", max_tokens, 1)
    checks.at_least("--expert-parallel", expert_parallel, 1)
    BudgetArg.parse(memory_budget)  # a bad size fails before the model loads
    device = parse_device(device)
    if expert_parallel > 1:
        from pwctl.runtime.parallel.launch import rank_device

        device = rank_device(device, expert_parallel)
    from pwctl.runtime.engine.batcher import BatchConfig
    from pwctl.runtime.engine.engine import Engine, serving_dtype
    from pwctl.runtime.engine.scheduler import SamplingParams

    opened, max_bits, experts, faults = checks.open_served_pack(
        pack, pol, device, max_bits, expert_parallel, verify
    )
    if faults:
        raise PwctlError(f"{checks.fault_summary(faults)}; --no-verify skips this check")
    engine = Engine(opened, device, serving_dtype(device, experts), experts, max_bits)
    cfg = BatchConfig(cuda_graphs=cuda_graphs)
    if pol is None:
        pol = engine.auto_policy(memory_budget, cfg)
    batcher = engine.start_batching(pol, memory_budget, cfg)
    budget = batcher.memory.total
    err_console.print(
        f"policy {pol}, device {device}, memory budget {budget / 1e6:.1f} MB", highlight=False
    )
    ids = engine.tokenizer(prompt).input_ids
    params = SamplingParams(max_tokens=max_tokens, stream=False)  # the text is read at the end
    if expert_parallel > 1:
        from pwctl.runtime.parallel.launch import ranks
        from pwctl.runtime.parallel.rank_metrics import gather_rank_metrics
        from pwctl.runtime.parallel.ranks import RankEngine

        bits = "-" if max_bits is None else str(max_bits)
        budget_arg = "-" if memory_budget is None else memory_budget
        kind = device.partition(":")[0]  # each owner takes its own GPU (`rank_device`)
        owner = [str(pack), str(pol), bits, budget_arg, kind]
        with ranks(expert_parallel, owner, device=device) as rank:
            prompts = [ids] if rank == 0 else []  # under torchrun other ranks only serve
            ep = RankEngine(engine)
            seqs = ep.generate_batch(prompts, params)
            per_rank = gather_rank_metrics(batcher, ep.exchange.stats)  # owners gather too
        if rank != 0:
            return
        (seq,) = seqs
        stats = ep.exchange.stats  # this rank's side of the all-to-alls
        exchange = {"ranks": expert_parallel, "exchanges": stats.calls,
                    "sent_bytes": stats.sent_bytes, "seconds": round(stats.seconds, 6),
                    "per_rank": per_rank}  # fmt: skip
    else:
        (seq,) = engine.generate_batch([ids], params)
        exchange = None
    console.print(seq.text, highlight=False, markup=False)
    write_json(
        json,
        {
            "policy": str(pol),
            "max_bits": engine.store.max_bits,
            "prompt": prompt,
            "completion": seq.text,
            "tokens": len(seq.output_ids),
            "finish_reason": seq.finish_reason,
            "expert_bytes": engine.store.expert_bytes(),
            "expert_parallel": exchange,
        },
    )
