"""Detokenization cost per generated token: decoding the whole output every step (what the
batcher did before session 5) against `pwctl.runtime.detokenizer.advance`. CPU only.
Usage: python recipes/perf_detokenize.py [tokens ...]   (default 1024 4096; the bundled
tiny-mixtral tokenizer on the bundled eval text)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from pwctl.runtime.detokenizer import TextOffsets, advance

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    models = ROOT / "pwctl" / "models"
    tok = AutoTokenizer.from_pretrained(models / "tiny-mixtral", local_files_only=True)
    ids = tok((models / "samples" / "eval.txt").read_text() * 4).input_ids
    for n in [int(a) for a in sys.argv[1:]] or [1024, 4096]:
        out: list[int] = []
        t = time.perf_counter()
        for token in ids[:n]:
            out.append(token)
            tok.decode(out, skip_special_tokens=True)
        whole = time.perf_counter() - t
        out, text, at = [], "", TextOffsets()
        t = time.perf_counter()
        for token in ids[:n]:
            out.append(token)
            text = advance(tok, out, text, at)
        step = time.perf_counter() - t
        print(
            f"{n} tokens: whole output each step {whole * 1e3:.0f} ms ({whole / n * 1e6:.0f} us a "
            f"token), incremental {step * 1e3:.0f} ms ({step / n * 1e6:.0f} us a token)"
        )


if __name__ == "__main__":
    main()
