"""pwctl serve PACK: the OpenAI-compatible HTTP server on the continuous-batching engine. With
--expert-parallel N, rank 0 (this process, which starts the others with the same options, or
rank 0 of torchrun's) runs the HTTP front end and spreads the requests over the ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pwctl.commands import checks
from pwctl.commands.checks import Verify
from pwctl.commands.common import (
    CudaGraphs,
    Device,
    MaxBits,
    MemoryBudget,
    PolicyOption,
    console,
    handles_errors,
    policy_or_auto,
)
from pwctl.device import parse_device
from pwctl.errors import PwctlError
from pwctl.policy import BudgetArg


@handles_errors
def run(
    pack: Annotated[Path, typer.Argument(help="pack folder")],
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8000,
    memory_budget: MemoryBudget = None,
    policy: PolicyOption = "auto",
    api_key: Annotated[
        str | None, typer.Option(help="require Authorization: Bearer KEY (not on /health)")
    ] = None,
    metrics_auth: Annotated[
        bool, typer.Option("--metrics-auth", help="/metrics needs the API key too")
    ] = False,
    max_request_bytes: Annotated[
        int, typer.Option(help="larger request bodies get 413 (default 2 MiB)")
    ] = 2_097_152,  # runtime.server.MAX_REQUEST_BYTES (not imported here: it loads fastapi)
    max_queue: Annotated[
        int, typer.Option(help="waiting requests before 429 (the server's: all ranks together)")
    ] = 64,
    max_seqs: Annotated[int, typer.Option(help="sequences running at once")] = 16,
    max_batch_tokens: Annotated[int, typer.Option(help="tokens per engine step")] = 256,
    max_model_len: Annotated[int | None, typer.Option(help="context (default: model's)")] = None,
    max_bits: MaxBits = None,
    cuda_graphs: CudaGraphs = True,
    verify: Verify = True,
    device: Device = "auto",
    expert_parallel: Annotated[
        int,
        typer.Option(
            help="ranks that share the experts, each serving its share of the requests with its "
            "own KV cache and --memory-budget (started here, or by torchrun); the CPU only for now"
        ),
    ] = 1,
) -> None:
    """Serve PACK over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics. The KV cache and the expert planes share --memory-budget."""
    options = dict(locals())  # what a started rank runs this with (serve_rank)
    # every option is checked before the model loads (minutes on a large pack)
    pol = policy_or_auto(policy)
    checks.at_least("--expert-parallel", expert_parallel, 1)
    BudgetArg.parse(memory_budget)  # a bad size fails before the model loads
    for name, value in (("--max-queue", max_queue), ("--max-seqs", max_seqs),
                        ("--max-batch-tokens", max_batch_tokens),
                        ("--max-request-bytes", max_request_bytes)):  # fmt: skip
        checks.at_least(name, value, 1)
    device = parse_device(device)
    if expert_parallel > 1:
        from pwctl.runtime.parallel.launch import rank_device

        device = rank_device(device, expert_parallel)
    if _front_end():
        checks.port_free(host, port)
    from pwctl.runtime.engine.batcher import BatchConfig
    from pwctl.runtime.engine.engine import Engine, serving_dtype
    from pwctl.runtime.serve.server import run_server
    from pwctl.runtime.serve.worker import EngineWorker

    opened, max_bits, experts, faults = checks.open_served_pack(
        pack, pol, device, max_bits, expert_parallel, verify, max_model_len
    )
    if experts == "paged" and any(f.plane is not None for f in faults):
        # the paged backend's host copy holds every plane: it needs them all
        raise PwctlError(f"{checks.fault_summary(faults)}; convert the model again")
    if experts == "paged":
        console.print("loading; a first run on this machine compiles the CUDA kernels (~2 min)")
    engine = Engine(opened, device, serving_dtype(device, experts), experts, max_bits)
    engine.store.add_faults(faults)  # logged by name; /health answers 503 while there are any
    cfg = BatchConfig(
        max_seqs, max_batch_tokens, max_queue, max_model_len=max_model_len, cuda_graphs=cuda_graphs
    )
    if pol is None:
        pol = engine.auto_policy(memory_budget, cfg)
    batcher = engine.start_batching(pol, memory_budget, cfg)
    metrics = batcher.metrics()
    console.print(
        f"pwctl serve {pack.name}: policy {pol} on {device}"
        + ("" if max_bits is None else f" up to {max_bits} bits")
        + f", budget {metrics['memory_budget_bytes'] / 1e6:.1f} MB "
        f"(planes {metrics['plane_bytes'] / 1e6:.1f}, "
        f"KV up to {metrics['kv_blocks_capacity']} blocks), "
        f"http://{host}:{port}/v1",
        highlight=False,
    )
    serving = {"metrics_auth": metrics_auth, "max_request_bytes": max_request_bytes}
    if expert_parallel == 1:
        run_server(EngineWorker(engine), pack.name, host, port, api_key, **serving)
        return
    from pwctl.runtime.parallel.launch import ranks
    from pwctl.runtime.parallel.ranks import RankEngine
    from pwctl.runtime.serve.ranked_worker import RankedWorker, follow

    rank_options = [_rank_options(options)]
    with ranks(expert_parallel, rank_options, RANK_MODULE, together=False, device=device) as rank:
        if rank == 0:
            run_server(RankedWorker(RankEngine(engine)), pack.name, host, port, api_key, **serving)
        else:
            follow(RankEngine(engine))


RANK_MODULE = "pwctl.commands.serve_rank"


def _front_end() -> bool:
    """Whether this process runs the HTTP front end: not a rank other than 0."""
    from pwctl.runtime.parallel.launch import torchrun_rank

    launched = torchrun_rank()
    return launched is None or launched[0] == 0


def _rank_options(options: dict[str, object]) -> str:
    """`run`'s options for a started rank, as one JSON argument (the pack as a string; no API
    key: a rank has no front end, and a command line is visible to other users)."""
    return json.dumps({**options, "pack": str(options["pack"]), "api_key": None})
