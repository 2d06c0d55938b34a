"""Incremental detokenization equals decoding the whole output, step by step and at the end."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pwctl.runtime.engine.detokenizer import (
    TextOffsets,
    advance,
    advance_many,
    decode_many,
    first_stop,
)

BUNDLED = Path(__file__).resolve().parents[1] / "pwctl" / "models" / "tiny-mixtral"
TEXT = "Der Bär läuft über die Straße — 東京 🚀 naïve café, it's 3.14 x² … ok.\n" * 3


def _sentencepiece_like():
    # Metaspace pre-tokenizer and decoder: a word's first piece carries its leading space, which
    # a decode drops at the start of the string (what SentencePiece / Llama tokenizers do)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(), decoders.Fuse()]
    )
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>", *bytes_])
    tok.train_from_iterator([TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def _tokenizers():
    return [
        ("bundled byte-level BPE", AutoTokenizer.from_pretrained(BUNDLED, local_files_only=True)),
        ("sentencepiece-like", _sentencepiece_like()),
    ]


def _check(tok, ids: list[int]) -> None:
    text, at = "", TextOffsets()
    for n in range(1, len(ids) + 1):
        text = advance(tok, ids[:n], text, at)
        full = tok.decode(ids[:n], skip_special_tokens=True)
        assert full.startswith(text), (n, text, full)
        assert len(full) - len(text) <= 8  # held back: at most an incomplete character or so
    assert advance(tok, ids, text, at, final=True) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name,tok", _tokenizers())
def test_incremental_text_equals_full_decode(name, tok):
    _check(tok, tok(TEXT).input_ids)  # real text, multi-byte characters split over tokens
    rng = random.Random(0)
    for _ in range(20):  # arbitrary ids: invalid UTF-8, special tokens, lone byte tokens
        _check(tok, [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))])


@pytest.mark.parametrize("name,tok", _tokenizers())
@pytest.mark.parametrize("clean_up", [False, True])
def test_many_sequences_in_one_call_equal_one_at_a_time(name, tok, clean_up):
    """`decode_many` gives what `decode` gives a list at a time (a tokenizer that cleans up
    tokenization spaces takes the call a list: its backend's batch does not clean up), and
    `advance_many` over sequences growing a token a step gives each one's `advance` text."""
    tok.clean_up_tokenization_spaces = clean_up
    rng = random.Random(1)
    lists = [[rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))] for _ in range(200)]
    lists.append(tok(" hello , world .").input_ids)
    assert decode_many(tok, lists) == [tok.decode(ids, skip_special_tokens=True) for ids in lists]
    seqs = [tok(TEXT[i * 7 :]).input_ids[:30] for i in range(8)]
    one = [("", TextOffsets()) for _ in seqs]
    many = [("", TextOffsets()) for _ in seqs]
    for n in range(1, 31):
        one = [(advance(tok, ids[:n], t, at), at) for ids, (t, at) in zip(seqs, one, strict=True)]
        items = [(ids[:n], t, at, n == 30) for ids, (t, at) in zip(seqs, many, strict=True)]
        texts = advance_many(tok, items)
        many = [(t, at) for t, (_, _, at, _) in zip(texts, items, strict=True)]
        if n < 30:
            assert [t for t, _ in many] == [t for t, _ in one]
    assert [t for t, _ in many] == [tok.decode(ids, skip_special_tokens=True) for ids in seqs]


def test_first_stop_equals_a_search_of_the_whole_text_at_every_step():
    # the old per-step search: every stop string over all of the text so far
    def whole(text: str, stops: list[str]) -> int:
        return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)

    rng = random.Random(1)
    hits = 0
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(30))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 6))) for _ in range(3)]
        checked = 0
        for end in sorted(rng.sample(range(1, 30), 6)) + [30]:  # steps add 1+ characters
            got = first_stop(text[:end], checked, stops)
            assert got == whole(text[:end], stops)
            if got >= 0:
                hits += 1
                break
            checked = end
    assert hits > 100  # the cases exercise stops that span steps, not only misses
