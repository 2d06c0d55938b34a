"""What several bench modes do alike: open a pack with --max-bits checked against it, and the
policies and serving engines of the long-context modes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pwctl.commands import checks
from pwctl.errors import PwctlError
from pwctl.policy import Policy, parse_policy

if TYPE_CHECKING:
    from pwctl.bench.longctx import EnginePool, RunSpec
    from pwctl.format.pack import Pack

DEFAULT_POLICIES = ["fp16", "uniform:8", "uniform:4", "uniform:3", "uniform:2"]


def open_checked(pack: Path, max_bits: int | None) -> Pack:
    """The pack, its --max-bits checked against it (before the model loads)."""
    from pwctl.runtime.engine.engine import open_pack

    opened = open_pack(pack)
    checks.max_bits(max_bits, opened.manifest.min_bits, opened.manifest.max_bits)
    return opened


def policies_or_default(policy: list[str] | None) -> list[Policy]:
    return [parse_policy(p) for p in (policy or DEFAULT_POLICIES)]


def needs_pack(mode: str, pack: Path | None) -> Path:
    if pack is None:
        raise PwctlError(f"bench {mode} needs a PACK")
    return pack


def serving_engines(
    pack: Path,
    memory_budget: str | None,
    max_seqs: int | None,
    max_batch_tokens: int,
    max_bits: int | None,
    device: str,
) -> tuple[RunSpec, EnginePool]:
    """--longbench and --synthetic: the run's serving spec and serve's engine a policy."""
    from pwctl.bench.longctx import EnginePool, RunSpec

    spec = RunSpec(memory_budget, max_seqs or RunSpec.max_seqs, max_batch_tokens)
    spec.validate()
    return spec, EnginePool(open_checked(pack, max_bits), device, max_bits)
