"""bench --ppl: perplexity, KL to fp16 and MoE output error per policy on the store engine (the
reference math), with RTN baselines and an optional KV-pressure trace."""

from __future__ import annotations

from pathlib import Path

from pwctl.commands import checks
from pwctl.commands.bench_modes.shared import needs_pack, open_checked, policies_or_default
from pwctl.commands.common import print_ppl, write_json
from pwctl.device import parse_device


def run(
    pack: Path | None,
    data: Path | None,
    policy: list[str] | None,
    rtn: list[int] | None,
    seq_len: int,
    kv_peak: float,
    max_tokens: int,
    max_bits: int | None,
    device: str,
    json: Path | None,
) -> None:
    checks.at_least("--seq-len", seq_len, 2)  # a window predicts its tokens after the first
    checks.at_least("--max-tokens", max_tokens, 1)
    checks.between("--kv-peak", kv_peak, 0, 1)
    for b in rtn or []:
        checks.between("--rtn", b, 1, 8)
    device = parse_device(device)
    from pwctl.bench.ppl import run_ppl
    from pwctl.bench.quantizer import add_rtn_variant
    from pwctl.build.checkpoint import EVAL_SAMPLE
    from pwctl.runtime.engine.engine import Engine
    from pwctl.text import token_windows

    pack = needs_pack("--ppl", pack)
    policies = policies_or_default(policy)
    opened = open_checked(pack, max_bits)
    checks.between("--seq-len", seq_len, 2, checks.model_context(opened.manifest.config))
    data = data or EVAL_SAMPLE
    engine = Engine(opened, device, experts="store", max_bits=max_bits)  # reference math
    policies += [add_rtn_variant(engine, b) for b in rtn or []]
    windows = token_windows(engine.tokenizer, data, seq_len, max_tokens)
    results = run_ppl(engine, windows, policies, kv_peak)
    print_ppl(f"perplexity on {data.name} ({results[0].tokens} tokens)", results)
    write_json(json, {"data": str(data), "results": [r.as_dict() for r in results]})
