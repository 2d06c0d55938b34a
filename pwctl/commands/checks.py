"""Option checks every command runs at the door, before a model loads: one PwctlError line each
(the CLI prints it and exits 2). Only light imports here (see common.py)."""

from __future__ import annotations

import math
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from pwctl.errors import PwctlError

if TYPE_CHECKING:
    from pwctl.policy import Policy

# serve and generate: the pack's checksums read whole before the model loads
Verify = Annotated[
    bool,
    typer.Option(
        "--verify/--no-verify", help="check every plane's and reference tensor's CRC first"
    ),
]


def at_least(name: str, value: float | None, low: float) -> None:
    """`value` (None: not given) is at least `low`."""
    if value is not None and not value >= low:  # `not >=`: NaN fails too
        raise PwctlError(f"{name} {value}: must be at least {low:g}")


def between(name: str, value: float | None, low: float, high: float, open_: bool = False) -> None:
    """`value` (None: not given) lies in [low, high], or in (low, high) with `open_`."""
    if value is None:
        return
    inside = low < value < high if open_ else low <= value <= high
    if not (math.isfinite(value) and inside):
        bounds = f"({low:g}, {high:g})" if open_ else f"[{low:g}, {high:g}]"
        raise PwctlError(f"{name} {value}: must be in {bounds}")


def model_context(config: dict[str, Any]) -> int:
    """The context a model was trained for (config.json's max_position_embeddings)."""
    n = config.get("max_position_embeddings")
    if not isinstance(n, int) or n < 1:
        raise PwctlError("the pack's config.json gives no max_position_embeddings")
    return n


def max_model_len(value: int | None, config: dict[str, Any]) -> None:
    """--max-model-len within [1, the model's context]: a longer context needs a rope-scaling
    choice pwctl does not make, and sizes the KV budget for lengths the model never saw."""
    if value is not None:
        between("--max-model-len", value, 1, model_context(config))


def max_bits(value: int | None, min_bits: int, pack_max: int) -> None:
    if value is not None and not min_bits <= value <= pack_max:
        raise PwctlError(f"--max-bits {value}: this pack holds widths {min_bits}..{pack_max}")


def port_free(host: str, port: int) -> None:
    """The address can be bound now (checked before the model loads, which takes minutes on
    a large pack; a server started later on the same port still wins the race)."""
    between("--port", port, 1, 65535)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise PwctlError(f"--host {host}: cannot resolve it ({e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            raise PwctlError(
                f"--host {host} --port {port}: cannot listen there ({e.strerror})"
            ) from None


def verify_pack(pack: Any) -> list[Any]:
    """Every plane and reference tensor of `pack` checked against its CRC-32 (Pack.verify),
    with a progress bar on stderr while it reads (a large pack takes a while to read whole;
    --no-verify skips this)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    from pwctl.commands.common import err_console

    columns = (TextColumn("verifying"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("verify", total=None)
        return pack.verify(lambda done, total: bar.update(task, completed=done, total=total))


def fault_summary(faults: list[Any]) -> str:
    more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
    return f"{faults[0]}{more}"


def open_served_pack(
    pack: Path, pol: Policy | None, device: str, widest: int | None, expert_parallel: int,
    verify: bool, context: int | None = None,
) -> tuple[Any, int | None, str, list[Any]]:  # fmt: skip
    """What generate and serve do before the engine: open `pack`, check --max-model-len
    (`context`) and --max-bits (`widest`) against it, choose the expert backend, keep this
    rank's share under expert parallelism, and verify what will be read. Returns the pack, the
    widest width to serve (the auto policy's cap where `pol` is None and none was given), the
    backend and the faults found."""
    from pwctl.policy import auto_max_bits
    from pwctl.runtime.engine.engine import experts_for, open_pack

    opened = open_pack(pack)
    m = opened.manifest
    max_model_len(context, m.config)
    max_bits(widest, m.min_bits, m.max_bits)
    if pol is None:
        widest = auto_max_bits(widest, m.min_bits, m.max_bits)
    experts = experts_for(pol, device)
    if expert_parallel > 1:  # this rank's experts' planes only, the only ones checked and read
        from pwctl.runtime.parallel.rank_pack import own_share

        opened = own_share(opened, expert_parallel, pol)
    faults = verify_pack(opened) if verify else []
    return opened, widest, experts, faults
