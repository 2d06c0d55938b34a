"""Serving setting (c), the comparison: transformers' own 16-bit generate at batch 1 on a checkpoint
(the synthetic Qwen1.5-MoE-sized one of recipes/perf_serving_gpu.sh), timed like `pwctl bench
--throughput`: time to first token (a 1-token generate), then decode tokens/s over the rest.

    python recipes/perf_hf_generate.py CKPT --input-len 2048 --output-len 256 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pwctl.build.checkpoint import EVAL_SAMPLE


def prompt_ids(ckpt: Path, n: int, device: str) -> torch.Tensor:
    """The first `n` tokens of the bundled eval text (the bench's first prompt), wrapped."""
    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    ids = tok(EVAL_SAMPLE.read_text()[: 16 * n]).input_ids
    while len(ids) < n:
        ids = ids + ids
    return torch.tensor([ids[:n]], device=device)


def timed_generate(model, ids: torch.Tensor, new_tokens: int) -> float:
    """Seconds for a greedy generate of exactly `new_tokens` tokens (eos ignored)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
    )  # fmt: skip
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="best of N for each timing")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--dtype", choices=("float16", "bfloat16"), default="bfloat16",
        help="as pwctl's fp16 policy runs on CUDA (its grouped GEMMs are bf16)",
    )  # fmt: skip
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=dtype).to("cuda").eval()
    ids = prompt_ids(a.ckpt, a.input_len, "cuda")
    timed_generate(model, ids, 4)  # warm-up: kernels, allocator
    ttft = min(timed_generate(model, ids, 1) for _ in range(a.repeats))
    total = min(timed_generate(model, ids, a.output_len) for _ in range(a.repeats))
    tpot = (total - ttft) / max(1, a.output_len - 1)
    report = {
        "checkpoint": str(a.ckpt),
        "device": torch.cuda.get_device_name(),
        "transformers_experts": str(getattr(model.config, "_experts_implementation", "default")),
        "dtype": a.dtype,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "ttft_s": ttft,
        "seconds": total,
        "tpot_s": tpot,
        "decode_tok_s": 1 / tpot,
        "output_tok_s": a.output_len / total,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(),
    }
    print(json.dumps(report, indent=1))
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
