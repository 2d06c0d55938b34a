"""Train the byte-level BPE tokenizer of the bundled models and tokenize the corpus splits.

Usage: .venv/bin/python recipes/train_tokenizer.py [--corpus data/corpus]
(recipes/build_corpus.py runs this as its last step.)

Outputs: data/tokenizer/ (tokenizer.json, tokenizer_config.json, special_tokens_map.json, loadable
with transformers.AutoTokenizer), a copy in pwctl/models/tokenizer/, and data/tokens/
{train,calib,eval}.bin (raw little-endian uint16 ids, documents joined by <|endoftext|>),
train.bin.gz and meta.json. The tokenizer sees the train split only; train is capped at
max_train_tokens by whole documents, keeping each source's share.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
SPLITS = ("train", "calib", "eval")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def require(condition: bool, message: str) -> None:
    """A check that stays on under `python -O`: a broken tokenizer must stop the build."""
    if not condition:
        raise RuntimeError(message)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Temp file in the same folder, then os.replace: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


def train_bpe(
    texts: Callable[[], Iterator[str]], vocab_size: int, eos: str, min_freq: int
) -> Tokenizer:
    """GPT-2-style byte-level BPE: any UTF-8 text round-trips exactly, no unknown tokens.
    The end-of-text token is the only special token, so it gets id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_freq,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    require(tok.token_to_id(eos) == 0, f"{eos} is not id 0")
    require(tok.get_vocab_size() == vocab_size, f"vocab {tok.get_vocab_size()} != {vocab_size}")
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, eos: str) -> None:
    """Write the three files transformers needs to load it as a PreTrainedTokenizerFast whose
    bos / eos / pad are all <|endoftext|>; each file lands atomically."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eos,
        "eos_token": eos,
        "pad_token": eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    special = {k: eos for k in ("bos_token", "eos_token", "pad_token")}
    atomic_write_bytes(out / "tokenizer.json", tok.to_str(pretty=True).encode("utf-8"))
    atomic_write_json(out / "tokenizer_config.json", config)
    atomic_write_json(out / "special_tokens_map.json", special)


def check_with_transformers(path: Path, texts: list[str], eos: str) -> None:
    """Load through AutoTokenizer the way the models will, and require exact round trips."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(str(path))
    require(isinstance(hf, PreTrainedTokenizerFast), f"AutoTokenizer gave {type(hf)}")
    require(hf.eos_token == eos and hf.eos_token_id == 0, "eos is not <|endoftext|> = 0")
    require(hf.bos_token_id == 0 and hf.pad_token_id == 0, "bos / pad are not id 0")
    for text in texts:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        require(hf.decode(ids) == text, f"transformers round trip failed on {text[:60]!r}")
    joined = hf.decode([*hf(texts[0])["input_ids"], hf.eos_token_id])
    require(joined == texts[0] + eos, "<|endoftext|> does not decode to itself")


def encode_docs(tok: Tokenizer, texts: list[str], batch: int = 256) -> list[np.ndarray]:
    """Token ids per document, each decoded back and compared: the files are lossless."""
    require(tok.get_vocab_size() <= 1 << 16, "token ids do not fit uint16")
    out: list[np.ndarray] = []
    for i in range(0, len(texts), batch):
        chunk = texts[i : i + batch]
        ids = [e.ids for e in tok.encode_batch(chunk, add_special_tokens=False)]
        back = tok.decode_batch(ids, skip_special_tokens=False)
        require(back == chunk, f"round trip failed in documents {i}..{i + len(chunk)}")
        out.extend(np.asarray(x, dtype=np.uint16) for x in ids)
    return out


def cap_train(
    rows: list[dict[str, Any]], ids: list[np.ndarray], cap: int
) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Keep whole documents (in their seeded order) so each source keeps its share of a corpus
    larger than `cap` tokens; returns everything when it already fits."""
    total = sum(len(x) + 1 for x in ids)
    if total <= cap:
        return rows, ids
    per_source: dict[str, int] = {}
    for row, x in zip(rows, ids, strict=True):
        per_source[row["source"]] = per_source.get(row["source"], 0) + len(x) + 1
    quota = {s: n * cap // total for s, n in per_source.items()}
    kept_rows, kept_ids = [], []
    for row, x in zip(rows, ids, strict=True):
        if len(x) + 1 <= quota[row["source"]]:
            quota[row["source"]] -= len(x) + 1
            kept_rows.append(row)
            kept_ids.append(x)
    return kept_rows, kept_ids


def join_docs(ids: list[np.ndarray], eos_id: int) -> np.ndarray:
    """Documents separated by <|endoftext|> (one before each document: every doc starts fresh)."""
    sep = np.array([eos_id], dtype=np.uint16)
    parts = [p for x in ids for p in (sep, x)]
    return np.concatenate(parts).astype("<u2") if parts else np.zeros(0, dtype="<u2")


def build_tokens(
    corpus: Path,
    tokenizer_dir: Path,
    tokens_dir: Path,
    package_dir: Path,
    recipe: dict[str, Any],
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Tokenizer from train, then every split to uint16 token files plus meta.json."""
    cfg = recipe["tokenizer"]
    eos = cfg["eos_token"]
    rows = {s: list(read_jsonl(corpus / f"{s}.jsonl")) for s in SPLITS}
    log(f"training BPE ({cfg['vocab_size']}) on {len(rows['train'])} train documents")
    tok = train_bpe(
        lambda: (r["text"] for r in rows["train"]), cfg["vocab_size"], eos, cfg["min_frequency"]
    )
    save_tokenizer(tok, tokenizer_dir, eos)
    probe = [r["text"] for r in rows["eval"][:50]] + ["Ünïcode “quotes” — 日本語 \t tabs\n\n"]
    check_with_transformers(tokenizer_dir, probe, eos)
    for name in TOKENIZER_FILES:  # what the bundled models ship
        atomic_write_bytes(package_dir / "tokenizer" / name, (tokenizer_dir / name).read_bytes())

    meta: dict[str, Any] = {
        "vocab_size": tok.get_vocab_size(),
        "dtype": "uint16",
        "byteorder": "little",
        "eos_token": eos,
        "eos_id": 0,
        "layout": "<|endoftext|> before every document",
        "tokenizer_sha256": hashlib.sha256(
            (tokenizer_dir / "tokenizer.json").read_bytes()
        ).hexdigest(),
        "tokens": {},
        "documents": {},
        "bytes": {},
        "bytes_per_token": {},
        "source_tokens": {},
    }
    for split in SPLITS:
        ids = encode_docs(tok, [r["text"] for r in rows[split]])
        split_rows = rows[split]
        if split == "train":
            full = sum(len(x) + 1 for x in ids)
            split_rows, ids = cap_train(split_rows, ids, cfg["max_train_tokens"])
            meta["train_tokens_before_cap"] = full
            meta["max_train_tokens"] = cfg["max_train_tokens"]
        arr = join_docs(ids, 0)
        atomic_write_bytes(tokens_dir / f"{split}.bin", arr.tobytes())
        text_bytes = sum(len(r["text"].encode("utf-8")) for r in split_rows)
        meta["tokens"][split] = int(arr.size)
        meta["documents"][split] = len(split_rows)
        meta["bytes"][split] = text_bytes
        meta["bytes_per_token"][split] = round(text_bytes / max(1, arr.size - len(ids)), 4)
        by_source: dict[str, int] = {}
        for row, x in zip(split_rows, ids, strict=True):
            by_source[row["source"]] = by_source.get(row["source"], 0) + len(x) + 1
        meta["source_tokens"][split] = dict(sorted(by_source.items()))
        log(f"{split}: {arr.size} tokens, {len(split_rows)} docs, {text_bytes} bytes")
    raw = (tokens_dir / "train.bin").read_bytes()
    atomic_write_bytes(tokens_dir / "train.bin.gz", gzip.compress(raw, compresslevel=9, mtime=0))
    meta["train_bin_gz_bytes"] = (tokens_dir / "train.bin.gz").stat().st_size
    atomic_write_json(tokens_dir / "meta.json", meta)
    log(f"train.bin.gz {meta['train_bin_gz_bytes']} bytes; bytes/token {meta['bytes_per_token']}")
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "corpus.toml")
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "corpus")
    parser.add_argument("--tokenizer-dir", type=Path, default=ROOT / "data" / "tokenizer")
    parser.add_argument("--tokens-dir", type=Path, default=ROOT / "data" / "tokens")
    parser.add_argument("--package-dir", type=Path, default=ROOT / "pwctl" / "models")
    args = parser.parse_args(argv)
    recipe = tomllib.loads(args.recipe.read_text(encoding="utf-8"))
    build_tokens(args.corpus, args.tokenizer_dir, args.tokens_dir, args.package_dir, recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
