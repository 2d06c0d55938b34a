"""pwctl generate PACK --prompt TEXT: one greedy generation on the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pwctl.commands.common import console, handles_errors, write_json
from pwctl.policy import parse_policy
from pwctl.runtime.engine import Engine, open_pack


@handles_errors
def run(
    pack: Annotated[Path, typer.Argument(help="pack folder")],
    prompt: Annotated[str, typer.Option(help="prompt text")],
    max_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 32,
    policy: Annotated[str, typer.Option(help="fp16 or uniform:B")] = "fp16",
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    json: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """Greedy-decode a continuation of PROMPT with the experts at POLICY's widths."""
    pol = parse_policy(policy)
    engine = Engine(open_pack(pack), device)
    engine.set_policy(pol)
    text = engine.generate(prompt, max_tokens)
    console.print(text, highlight=False, markup=False)
    write_json(
        json,
        {
            "policy": str(pol),
            "prompt": prompt,
            "completion": text,
            "expert_bytes": engine.store.expert_bytes(),
        },
    )
