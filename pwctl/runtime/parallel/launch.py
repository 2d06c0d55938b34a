"""Starting the ranks of `--expert-parallel N`: under torchrun (RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT in the environment) each process is already a rank; otherwise the command's own
process is rank 0 and starts ranks 1..N-1 itself, each `python -m MODULE ARGS`: for generate
`pwctl.runtime.parallel.owner` on the same pack and policy (those serve only as their experts'
owners: the request, and the output, are rank 0's); for bench --throughput and serve the
command's own code with rank 0's options, serving its share of the requests (serve: those rank 0's
front end gives it). Gloo on the CPU; NCCL on CUDA, one GPU a rank (`rank_device`: the local
rank's GPU, LOCAL_RANK under torchrun)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from pwctl.errors import PwctlError
from pwctl.runtime.parallel.exchange import join

TIMEOUT_S = 120.0  # a rank that dies fails the others' next exchange within this
OWNER = "pwctl.runtime.parallel.owner"


def leave(group: dist.ProcessGroup | None = None) -> None:
    """Leave `group` (default: the whole group) with every other rank: a rank whose process
    exits while gloo's threads still talk to a peer can abort ("terminate called without an
    active exception"), and a rank that tears the group down before the others have read the
    last collective fails them."""
    try:
        dist.barrier(group)
    except RuntimeError as e:
        raise PwctlError(f"a rank left before the others ({e})") from None
    dist.destroy_process_group(group)


def rank_entry(main: Callable[[list[str]], int]) -> None:
    """A started rank's module entry: exit with `main(argv)`'s status, or print a PwctlError as
    one line and exit 2 (the others then fail their next exchange within TIMEOUT_S)."""
    try:
        sys.exit(main(sys.argv[1:]))
    except PwctlError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def rank_device(device: str, n: int) -> str:
    """This rank's device for `--device device` under `--expert-parallel n`: the CPU as it is;
    on CUDA the GPU of this rank's local index (LOCAL_RANK under torchrun, else RANK: the ranks
    `ranks` starts live on this host; rank 0, which starts them, has neither and takes GPU 0),
    made the current device. NCCL needs a GPU a rank, so fewer local GPUs than ranks is an error
    here, before the model loads."""
    if not device.startswith("cuda"):
        return device
    visible = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    here = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    if here > visible:
        raise PwctlError(
            f"--expert-parallel {n} on CUDA runs a GPU a rank: {here} ranks on this host, "
            f"{visible} GPU(s) visible"
        )
    if device != "cuda" and device != f"cuda:{local}":
        raise PwctlError(
            f"--device {device} with --expert-parallel: each rank takes its own GPU (--device cuda)"
        )
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def own_rank() -> int:
    """This process's rank, known before the group is joined (the engine loads its share of the
    pack first): the launcher's, else 0, as `ranks` makes the command's own process rank 0."""
    launched = torchrun_rank()
    return 0 if launched is None else launched[0]


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world) when torchrun (or another launcher) started this process as a rank."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


@contextmanager
def ranks(
    n: int, args: list[str], module: str = OWNER, together: bool = True, device: str = "cpu"
) -> Iterator[int]:
    """This process as a rank of `n` (yields its rank): under a launcher as it says, else rank
    0 with ranks 1..n-1 started as `python -m module args` (default: owners). `device`: this
    rank's (`rank_device`), which picks the backend.
    On exit the group is left (`together`: at a barrier, where every rank's work ends in step;
    serve's rank 0 ends by a signal, once it has told the others to stop) and started ranks are
    waited for (one that failed: an error)."""
    launched = torchrun_rank()
    children: list[subprocess.Popen] = []
    if launched is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", _free_port())
        for r in range(1, n):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(n)}
            cmd = [sys.executable, "-m", module, *args]
            children.append(subprocess.Popen(cmd, env=env))
        launched = (0, n)
    rank, world = launched
    if world != n:
        raise PwctlError(f"--expert-parallel {n}, but the launcher started {world} ranks")
    try:
        join(rank, world, TIMEOUT_S, device)
        yield rank
        if together:
            leave()
    except PwctlError as e:  # e.g. a peer died: gloo's group then aborts the process when it
        print(f"error: {e}", file=sys.stderr, flush=True)  # is torn down, so leave at once
        os._exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        failed = [c.args for c in children if c.wait(timeout=TIMEOUT_S) != 0]
    if failed:  # after the body ran through (raised here, it would hide the body's error)
        raise PwctlError(f"{len(failed)} expert-parallel rank(s) failed: see their output")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])
