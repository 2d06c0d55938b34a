"""Incremental detokenization: each step decodes a short window of a sequence's newest tokens
instead of its whole output (decoding everything every step is quadratic in the output length,
and it runs under the tokenizer lock on the engine's thread).

The window starts at the token after the previous step's window, so a tokenizer that treats the
first token of a string specially (a SentencePiece word's leading space) sees the same first token
in both decodes, and only the difference is appended. Text that ends in an incomplete UTF-8
character (U+FFFD) is held back until the character completes, or until the sequence ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class TextOffsets:
    prefix: int = 0  # first token of the decode window
    read: int = 0  # tokens whose text is in the sequence's text


def advance(tokenizer: Any, ids: list[int], text: str, at: TextOffsets, final: bool = False) -> str:
    """`text` (the text of ids[:at.read]) extended by what ids[at.read:] add; `at` moves on.
    final: emit a held-back incomplete character too (the sequence ends here)."""
    before = tokenizer.decode(ids[at.prefix : at.read], skip_special_tokens=True)
    after = tokenizer.decode(ids[at.prefix :], skip_special_tokens=True)
    if len(after) > len(before) and (final or not after.endswith("\ufffd")):
        text += after[len(before) :]
        at.prefix, at.read = at.read, len(ids)
    return text


def first_stop(text: str, checked: int, stops: Sequence[str]) -> int:
    """Where the earliest stop string in `text` starts (-1: none), when none lies within
    text[:checked]: one that ends past `checked` starts at most len(stop) - 1 characters before."""
    hits = [i for i in (text.find(s, max(0, checked - len(s) + 1)) for s in stops if s) if i >= 0]
    return min(hits, default=-1)
