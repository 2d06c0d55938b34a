"""Build the text corpus, tokenizer and token files for the bundled tiny MoE models.

Usage: .venv/bin/python recipes/build_corpus.py [--out data/corpus] [--skip-install]

The recipe (sources, licences, split roles, sizes) is data in recipes/corpus.toml. Steps:
install the packages (idempotent), extract clean text as whole documents, split train / calib /
eval by whole documents with a seeded hash (one source held out of training entirely), write the
corpus, the bundled public-domain samples, then the tokenizer and token files
(recipes/train_tokenizer.py). Every output file is written atomically.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import html
import json
import os
import re
import struct
import subprocess
import sys
import tarfile
import tomllib
import unicodedata
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPLITS = ("train", "calib", "eval")
SWORD_DIR = Path("/usr/share/sword")


@dataclass(frozen=True)
class Document:
    """One whole document; `group` is the key the split is drawn from."""

    source: str
    doc_id: str
    text: str
    group: str


# ---------------------------------------------------------------- atomic writes and hashing


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a file so readers never see a half-written one (temp file, then os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def atomic_write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Stream JSON lines to a temp file and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def require(condition: bool, message: str) -> None:
    """A check that stays on under `python -O` (unlike assert): bad data must stop the build."""
    if not condition:
        raise RuntimeError(message)


def unit_hash(*parts: str) -> float:
    """Deterministic number in [0, 1) from strings: the same on every machine and run."""
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# ---------------------------------------------------------------- installing the sources


def apt_installed(package: str) -> bool:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True
    )
    return result.returncode == 0 and "install ok installed" in result.stdout


def install_source(spec: dict[str, Any], cache: Path, state: dict[str, bool]) -> None:
    """Install one source's package unless it is already there (apt, npm, or an unpacked sdist)."""
    kind = spec["kind"]
    if kind == "apt":
        missing = [p for p in spec["packages"] if not apt_installed(p)]
        if not missing:
            return
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if not state.get("apt_updated"):
            subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
            state["apt_updated"] = True
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
        subprocess.run(cmd, check=True, env=env)
    elif kind == "npm":
        name, version = spec["spec"].rsplit("@", 1)
        manifest = cache / "node_modules" / name / "package.json"
        if manifest.exists() and json.loads(manifest.read_text())["version"] == version:
            return
        cache.mkdir(parents=True, exist_ok=True)  # saved to cache/package.json: later installs
        cmd = ["npm", "install", "--prefix", str(cache), "--save-exact", "--no-audit", "--no-fund"]
        subprocess.run([*cmd, spec["spec"]], check=True)  # would prune an unsaved package
    elif kind == "pip-download":
        name, version = spec["spec"].split("==")
        if (cache / f"{name}-{version}").is_dir():
            return
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, "-d", str(cache), spec["spec"]], check=True)
        with tarfile.open(cache / f"{name}-{version}.tar.gz") as tar:
            tar.extractall(cache, filter="data")
    else:
        raise ValueError(f"unknown install kind {kind!r}")


# ---------------------------------------------------------------- cleaning


_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u202a-\u202e\u2060\ufeff]")


def clean_text(text: str, dedupe_line_chars: int) -> str:
    """Normalise Unicode and whitespace; drop lines with no letters or digits and long repeated
    lines (boilerplate); keep single blank lines as paragraph breaks."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    seen: set[str] = set()
    out: list[str] = []
    for raw in text.split("\n"):
        line = " ".join(_CONTROL.sub("", raw).split())
        if not any(c.isalnum() for c in line):
            line = ""
        if len(line) >= dedupe_line_chars:
            if line in seen:
                continue
            seen.add(line)
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


# ---------------------------------------------- SWORD modules (bibles, commentaries)

_NOTE = re.compile(r"<note\b[^>]*/>|<note\b.*?</note>|<rdg\b.*?</rdg>", re.S)
_LINE_BREAK = re.compile(r"<(?:lb|l|item|/item|/row|speaker|/speaker)\b[^>]*>")
_PARA_BREAK = re.compile(
    r"<(?:lg|chapter|/title|/p|p|title)\b[^>]*>|<div\b(?![^>]*x-milestone)[^>]*>"
)
_TAG = re.compile(r"<[^>]+>")
_GAP_BEFORE_PUNCT = re.compile(r"\x00+\s*(?=[.,;:!?’”)\]])")


def osis_to_text(xml: str) -> str:
    """Plain text from a SWORD module's OSIS: notes and variant readings dropped, paragraph and
    title markers turned into blank lines, poetry lines into line breaks, other tags stripped."""
    xml = xml.replace("</w><w", "</w> <w")
    xml = _NOTE.sub("\x00", xml)
    xml = xml.replace("</cell><cell>", " ")
    xml = _PARA_BREAK.sub("\x02", _LINE_BREAK.sub("\x01", xml))
    text = html.unescape(_TAG.sub("", xml))
    text = _GAP_BEFORE_PUNCT.sub("", text).replace("\x00", " ")
    text = re.sub(r"[\s\x01]*\x02[\s\x01\x02]*", "\n\n", text)  # a paragraph break wins
    return re.sub(r"[ \t]*\x01[\s\x01]*", "\n", text)


def sword_blocks(module: str) -> Iterator[tuple[str, str]]:
    """Yield (testament, decompressed block) of a zText/zCom module in canon order.

    The blocks are read straight from the module files because diatheke 4.8 renders these
    modules badly: it repeats psalm titles before thousands of verses and prints ~50 KB windows
    of Matthew Henry for every verse. A block is one book (or one chapter) of clean OSIS."""
    confs = [p.read_text(encoding="utf-8") for p in sorted((SWORD_DIR / "mods.d").glob("*.conf"))]
    matching = [c for c in confs if re.search(rf"^\[{re.escape(module)}\]\s*$", c, re.M)]
    if not matching:
        raise FileNotFoundError(f"SWORD module {module} is not installed")
    conf = matching[0]
    fields = dict(re.findall(r"^(\w+)=(.*)$", conf, re.M))
    if fields.get("CompressType", "").strip() != "ZIP":
        raise ValueError(f"{module}: only ZIP-compressed SWORD modules are supported")
    data_dir = (SWORD_DIR / fields["DataPath"].strip()).resolve()
    for testament in ("ot", "nt"):
        for index_path in sorted(data_dir.glob(f"{testament}.?zs")):
            index = index_path.read_bytes()
            blob = index_path.with_suffix(index_path.suffix[:-1] + "z").read_bytes()
            for i in range(len(index) // 12):
                offset, size, _ = struct.unpack_from("<III", index, i * 12)
                if size:
                    yield testament, zlib.decompress(blob[offset : offset + size]).decode("utf-8")


def extract_sword(cfg: dict[str, Any], source: str, group: str | None) -> Iterator[Document]:
    """One document per book (`doc = "book"`: a bible book, Matthew Henry on one book; a book
    spread over several blocks is joined) or per block (`doc = "chapter"`: one psalm of the
    Treasury of David). Front matter before the first book is its own document."""
    books: list[tuple[str, list[str]]] = []
    for n, (testament, block) in enumerate(sword_blocks(cfg["module"])):
        if cfg["doc"] == "chapter":
            chapter = re.search(r'<chapter [^>]*osisID="([\w.]+)"', block)
            doc_id = chapter.group(1) if chapter else f"{testament}-front-{n}"
            yield Document(source, doc_id, osis_to_text(block), f"{source}/{doc_id}")
            continue
        for piece in re.split(r'(?=<div (?![^>]*eID=)[^>]*type="book")', block):
            book = re.search(r'<div (?![^>]*eID=)[^>]*osisID="([\w.]+)"[^>]*type="book"', piece)
            if book:
                books.append((book.group(1), [piece]))
            elif books:
                books[-1][1].append(piece)
            elif piece.strip():
                books.append((f"{testament}-front", [piece]))
    for doc_id, pieces in books:
        key = f"{group}/{doc_id}" if group else f"{source}/{doc_id}"
        yield Document(source, doc_id, osis_to_text("".join(pieces)), key)


# ---------------------------------------------------------------- npm and pip sources


def extract_sotu(cfg: dict[str, Any], source: str, root: Path) -> Iterator[Document]:
    """One document per address (the .txt files; the .json twins hold the same text)."""
    for path in sorted((root / cfg["path"]).glob("*.txt")):
        text = html.unescape(path.read_text(encoding="utf-8"))
        yield Document(source, path.stem, text, f"{source}/{path.stem}")


_BROWN_TOKEN = re.compile(r"(\S+)/[^\s/]+")
_NO_SPACE_BEFORE = re.compile(r" (?=[.,;:!?)\]}%]|'s\b|n't\b|'re\b|'ll\b|'ve\b|'d\b|'m\b)")


def detokenise_brown(sentence: str) -> str:
    """`The/at jury/nn said/vbd ,/,` -> `The jury said,` with straight quotes restored."""
    words = _BROWN_TOKEN.findall(sentence)
    text = " ".join(words).replace("`` ", '"').replace(" ''", '"').replace("``", '"')
    text = text.replace("''", '"').replace("( ", "(").replace("[ ", "[")
    return _NO_SPACE_BEFORE.sub("", text).replace(";;", ";")


def extract_brown(cfg: dict[str, Any], source: str, root: Path) -> Iterator[Document]:
    """One document per Brown file (~2,000 words); tagged sentences become plain paragraphs."""
    for path in sorted((root / cfg["path"]).glob("c[a-r][0-9][0-9]")):
        chunks = re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))
        paras = [detokenise_brown(" ".join(c.split())) for c in chunks if c.strip()]
        yield Document(source, path.name, "\n\n".join(paras), f"{source}/{path.name}")


def extract_gutenberg(cfg: dict[str, Any], source: str, root: Path) -> Iterator[Document]:
    """One document per work; line breaks are kept because they are verse lines."""
    for path in sorted((root / cfg["path"]).glob(cfg["pattern"])):
        name = path.name.removesuffix(".txt")
        text = html.unescape(path.read_text(encoding="utf-8"))
        yield Document(source, name, text, f"{source}/{name}")


# ---------------------------------------------------------------- reStructuredText docs

_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_OPTION = re.compile(r"^:[\w-]+:(\s.*)?$")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+_.:<>])\1{2,}$")
_TABLE_RULE = re.compile(r"^[+|]?[-=+|: ]*[+|]$|^[=\- ]{3,}$")
_SIGNATURES = {
    "function", "method", "class", "attribute", "data", "exception", "decorator", "module",
    "describe", "option", "cmdoption", "envvar", "classmethod", "staticmethod", "property",
    "c:function", "c:type", "c:member", "c:macro", "c:var", "py:function", "py:method",
    "py:class", "py:attribute", "py:data", "py:module", "opcode", "pdbcommand",
}  # fmt: skip
_PROSE_ARGS = {"note", "warning", "seealso", "tip", "important", "caution", "hint", "attention"}
_DROP_BLOCKS = {
    "toctree", "image", "figure", "raw", "include", "literalinclude", "kernel-doc", "index",
    "only", "highlight", "sectionauthor", "moduleauthor", "testsetup", "testcleanup",
    "tabularcolumns", "contents", "kernel-feat", "kernel-abi", "kernel-include", "productionlist",
    "graphviz", "csv-table", "flat-table", "list-table", "cssclass", "rst-class", "ifconfig",
}  # fmt: skip


def _target_text(m: re.Match[str]) -> str:
    """`text <target>` -> text; `~mod.func` -> mod.func (the reader-visible part)."""
    text = m.group(1)
    if not text.startswith("<"):
        text = re.sub(r"\s*<[^<>]*>$", "", text)
    return text.lstrip("~!")


_INLINE: list[tuple[re.Pattern[str], Any]] = [
    (re.compile(r":[\w:.+-]+:`([^`]+)`"), _target_text),  # :role:`text <target>`
    (re.compile(r"``([^`]+?)``"), r"\1"),  # ``literal``
    (re.compile(r"`([^`]+?)`__?"), _target_text),  # `link <url>`_
    (re.compile(r"`([^`]+)`"), r"\1"),  # `interpreted`
    (re.compile(r"\*\*(\S(?:[^*\n]*?\S)?)\*\*"), r"\1"),  # **strong**
    (re.compile(r"(?<![\w*\\])\*(\S(?:[^*\n]*?\S)?)\*(?![\w*])"), r"\1"),  # *emphasis*
    (re.compile(r"\|(\w[\w -]*)\|_?"), r"\1"),  # |substitution|
    (re.compile(r"(?<=[A-Za-z0-9])__?(?=[\s.,;:)]|$)", re.M), ""),  # reference_
    (re.compile(r" ::$", re.M), ""),  # paragraph ::
    (re.compile(r"(?<=\S)::$", re.M), ":"),  # paragraph::
    (re.compile(r"\\([*_`|\\])"), r"\1"),  # backslash escapes
    (re.compile(r"^:(\w[\w -]*):(?=\s|$)", re.M), r"\1:"),  # :Field: value
]


def rst_to_text(src: str) -> str:
    """Prose from reStructuredText: drop comments, targets, section underlines, table rules and
    non-prose directives with their bodies; keep API signatures and admonition text; unwrap
    inline markup to its text."""
    out: list[str] = []
    skip_indent: int | None = None
    in_options = False
    for line in src.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        if in_options and _OPTION.match(stripped):
            continue
        in_options = False
        directive = _DIRECTIVE.match(line)
        if directive:
            name, arg = directive.group(2), directive.group(3)
            if name in _DROP_BLOCKS:
                skip_indent = indent
            elif arg and (name in _SIGNATURES or name in _PROSE_ARGS):
                out.append(arg)
            in_options = True
            continue
        if stripped.startswith(".."):  # comment, _target:, |substitution| definition
            skip_indent = indent
            continue
        if stripped == "::" or _UNDERLINE.match(stripped) or _TABLE_RULE.match(stripped):
            out.append("")
            continue
        out.append(stripped)
    text = "\n".join(out)
    for pattern, repl in _INLINE:  # on the whole text: inline markup may span lines
        text = pattern.sub(repl, text)
    return text


def extract_rst(cfg: dict[str, Any], source: str, root: Path) -> Iterator[Document]:
    """One document per .rst page (optionally gzip-compressed), translations excluded."""
    base = Path(cfg["path"])
    excludes = cfg.get("exclude", [])
    for path in sorted(base.glob(cfg["pattern"])):
        rel = path.relative_to(base).as_posix()
        if any(fnmatch.fnmatch(rel, pat) for pat in excludes):
            continue
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        doc_id = re.sub(r"\.rst(\.txt|\.gz)?$", "", rel)
        yield Document(
            source, doc_id, rst_to_text(raw.decode("utf-8", "replace")), f"{source}/{doc_id}"
        )


# ---------------------------------------------------------------- GCIDE dictionary

_B64_DIGITS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64 = {c: i for i, c in enumerate(_B64_DIGITS)}


def _dictd_number(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64[c]
    return n


_GCIDE_ACCENTS = {"'": "\u0301", "`": "\u0300", '"': "\u0308", "^": "\u0302", "~": "\u0303",
                  "=": "\u0304", ",": "\u0327"}  # fmt: skip
_GCIDE_ENTITIES = {"ae": "æ", "AE": "Æ", "oe": "œ", "OE": "Œ", "yogh": "ȝ", "thorn": "þ",
                   "eth": "ð", "frac12": "½", "frac14": "¼", "frac34": "¾", "deg": "°"}  # fmt: skip


def _gcide_char(m: re.Match[str]) -> str:
    """GCIDE's ASCII character markup: [\'o] -> ó, [ae] -> æ; unknown ones are dropped."""
    body = m.group(1)
    if len(body) == 2 and body[0] in _GCIDE_ACCENTS and body[1].isalpha():
        return unicodedata.normalize("NFC", body[1] + _GCIDE_ACCENTS[body[0]])
    return _GCIDE_ENTITIES.get(body, "")


def gcide_entry_text(entry: str) -> str:
    """Dictionary entry as paragraphs: pronunciations, [1913 Webster]-style source tags, cross
    reference braces and character markup removed; wrapped lines joined."""
    entry = re.sub(r"\\[^\\\n]*\\", "", entry)
    entry = re.sub(r"^\s*\[[^\]]*\]\s*$", "", entry, flags=re.M)
    entry = re.sub(r"\[([`'\"^~=,][A-Za-z]|[a-z]{2,8}\d{0,2}|AE|OE)\]", _gcide_char, entry)
    entry = re.sub(r"\{([^{}]*)\}", lambda m: re.sub(r'[*"`]', "", m.group(1)), entry)
    entry = re.sub(r"\[(?:\d{4} )?Webster\]|\[WordNet[^\]]*\]|\[PJC\]|\(\s*\)", "", entry)
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", entry)]
    return "\n".join(p for p in paras if p)


def extract_gcide(cfg: dict[str, Any], source: str, root: Path) -> Iterator[Document]:
    """One document per three-letter headword prefix (`aba`, `abb`, ...), in index order."""
    data = gzip.decompress(Path(cfg["path"]).read_bytes())
    entries: dict[int, tuple[str, int]] = {}
    for line in Path(cfg["index"]).read_text(encoding="utf-8").splitlines():
        head, off, size = line.split("\t")
        if not head.startswith("00-database"):
            entries.setdefault(_dictd_number(off), (head, _dictd_number(size)))
    docs: dict[str, list[str]] = {}
    for offset in sorted(entries):
        head, size = entries[offset]
        letters = re.sub(r"[^a-z]", "", unicodedata.normalize("NFKD", head).lower())
        key = (letters + "__")[:3] if letters else "___"
        text = gcide_entry_text(data[offset : offset + size].decode("utf-8", "replace"))
        docs.setdefault(key, []).append(text)
    for key in sorted(docs):
        yield Document(source, key, "\n\n".join(docs[key]), f"{source}/{key}")


# ---------------------------------------------------------------- documents, caps, splits


def source_documents(src: dict[str, Any], cache: Path, cfg: dict[str, Any]) -> list[Document]:
    """Extract, clean, filter and (when max_bytes is set) cap one source's documents."""
    ext = src["extract"]
    kind = ext["kind"]
    if kind == "sword":
        raw: Iterable[Document] = extract_sword(ext, src["name"], src.get("group"))
    else:
        extractors: dict[str, Callable[[dict[str, Any], str, Path], Iterator[Document]]] = {
            "sotu": extract_sotu,
            "brown": extract_brown,
            "gutenberg": extract_gutenberg,
            "rst": extract_rst,
            "gcide": extract_gcide,
        }
        raw = extractors[kind](ext, src["name"], cache)
    docs: list[Document] = []
    for d in raw:
        text = clean_text(d.text, cfg["dedupe_line_chars"])
        if len(text) >= cfg["min_doc_chars"]:
            docs.append(Document(d.source, d.doc_id, text, d.group))
    ids = [d.doc_id for d in docs]
    require(len(ids) == len(set(ids)), f"{src['name']}: duplicate document ids")
    if "max_bytes" in ext:  # keep whole documents in a seeded order until the cap
        docs.sort(key=lambda d: unit_hash(cfg["seed"], "keep", d.source, d.doc_id))
        kept, total = [], 0
        for d in docs:
            size = len(d.text.encode("utf-8"))
            if total + size <= ext["max_bytes"]:
                kept.append(d)
                total += size
        docs = kept
    return docs


def assign_split(doc: Document, role: str, cfg: dict[str, Any]) -> str:
    """Whole-document split from a seeded hash of the document's group key."""
    u = unit_hash(cfg["seed"], "split", doc.group)
    if role == "heldout":
        return "calib" if u < cfg["heldout_calib"] else "eval"
    if u < cfg["train"]:
        return "train"
    return "calib" if u < cfg["train"] + cfg["calib"] else "eval"


def build_splits(
    recipe: dict[str, Any], cache: Path, log: Callable[[str], None]
) -> tuple[dict[str, list[Document]], list[dict[str, Any]]]:
    """All sources -> documents per split (exact duplicate texts kept once), plus the source
    statistics recorded in sources.json."""
    cfg = recipe["corpus"]
    splits: dict[str, list[Document]] = {s: [] for s in SPLITS}
    seen_text: set[str] = set()
    stats = []
    for src in recipe["source"]:
        docs = source_documents(src, cache / src["install"]["kind"], cfg)
        row: dict[str, Any] = {
            k: src[k] for k in ("name", "title", "licence", "public_domain", "role")
        }
        row["install"] = src["install"]
        row["documents"] = {s: 0 for s in SPLITS}
        row["bytes"] = {s: 0 for s in SPLITS}
        duplicates = 0
        for d in docs:
            digest = hashlib.sha256(d.text.encode("utf-8")).hexdigest()
            if digest in seen_text:
                duplicates += 1
                continue
            seen_text.add(digest)
            split = assign_split(d, src["role"], cfg)
            splits[split].append(d)
            row["documents"][split] += 1
            row["bytes"][split] += len(d.text.encode("utf-8"))
        row["duplicates_dropped"] = duplicates
        stats.append(row)
        log(f"{src['name']:<12} docs {row['documents']}  bytes {row['bytes']}")
    for split in SPLITS:  # a fixed, source-mixed order
        splits[split].sort(key=lambda d: unit_hash(cfg["seed"], "order", d.source, d.doc_id))
    return splits, stats


def check_splits(splits: dict[str, list[Document]], heldout: list[str]) -> dict[str, Any]:
    """Assert no calib/eval document (by id or by text) is in train and held-out sources have no
    training text; report how many long calib/eval paragraphs also occur verbatim in train."""
    train_ids = {(d.source, d.doc_id) for d in splits["train"]}
    train_texts = {hashlib.sha256(d.text.encode()).digest() for d in splits["train"]}
    train_paras = {p for d in splits["train"] for p in d.text.split("\n") if len(p) >= 200}
    report: dict[str, Any] = {}
    for split in ("calib", "eval"):
        paras = [p for d in splits[split] for p in d.text.split("\n") if len(p) >= 200]
        for d in splits[split]:
            require((d.source, d.doc_id) not in train_ids, f"{d.doc_id} in train and {split}")
            digest = hashlib.sha256(d.text.encode()).digest()
            require(digest not in train_texts, f"{d.doc_id}: its text is also in train")
        shared = sum(p in train_paras for p in paras)
        report[split] = {"long_paragraphs": len(paras), "also_in_train": shared}
    leaked = sum(d.source in heldout for d in splits["train"])
    require(leaked == 0, f"{leaked} documents of held-out sources {heldout} are in train")
    report["heldout_train_documents"] = leaked
    return report


# ---------------------------------------------------------------- bundled samples


def pick_sample(docs: list[Document], sources: list[str], target: int) -> str:
    """About `target` bytes of whole paragraphs, taken from the start of each public-domain
    document in split order (so documents are whole or cut at a paragraph end), an even share
    per source first so no single source dominates, then topped up from any of them."""
    streams = {s: [p for d in docs if d.source == s for p in d.text.split("\n\n")] for s in sources}
    streams = {s: paras for s, paras in streams.items() if paras}
    chosen: dict[str, list[str]] = {s: [] for s in streams}
    used = dict.fromkeys(streams, 0)
    for quota in (target // max(1, len(streams)), target):
        for source, paras in streams.items():
            while paras:
                size = len(paras[0].encode("utf-8")) + 2
                if used[source] + size > quota or sum(used.values()) + size > target:
                    break
                chosen[source].append(paras.pop(0))
                used[source] += size
    return "\n\n".join(p for source in streams for p in chosen[source]) + "\n"


def write_samples(
    splits: dict[str, list[Document]], recipe: dict[str, Any], pkg: Path
) -> dict[str, int]:
    """pwctl/models/samples/{calib,eval}.txt and their README."""
    cfg = recipe["samples"]
    sizes = {}
    for split in ("calib", "eval"):
        text = pick_sample(splits[split], cfg["sources"], cfg["target_bytes"])
        size = len(text.encode("utf-8"))
        require(cfg["min_bytes"] <= size <= cfg["max_bytes"], f"{split} sample: {size} bytes")
        atomic_write_text(pkg / "samples" / f"{split}.txt", text)
        sizes[split] = size
    titles = {s["name"]: s["title"] for s in recipe["source"]}
    names = ", ".join(titles[s].split(" (")[0] for s in cfg["sources"])
    readme = (
        "# Bundled text samples\n\n"
        "- `calib.txt`: calibration text for `pwctl profile` / `pwctl fit-residual`, drawn from "
        "the calib split of the corpus (recipes/corpus.toml).\n"
        "- `eval.txt`: held-out text for `pwctl bench --ppl`, drawn from the eval split; no "
        "document in either file is in the bundled models' training data.\n"
        f"- Sources: {names}. Whole documents or whole paragraphs, separated by blank lines.\n"
        "- Licence: public domain (all texts; the State of the Union addresses are US "
        "government works). Rebuild with `python recipes/build_corpus.py`.\n"
    )
    atomic_write_text(pkg / "samples" / "README.md", readme)
    return sizes


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "corpus.toml")
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "corpus")
    parser.add_argument("--cache", type=Path, default=ROOT / "data" / "cache")
    parser.add_argument("--tokenizer-dir", type=Path, default=ROOT / "data" / "tokenizer")
    parser.add_argument("--tokens-dir", type=Path, default=ROOT / "data" / "tokens")
    parser.add_argument("--package-dir", type=Path, default=ROOT / "pwctl" / "models")
    parser.add_argument("--skip-install", action="store_true", help="use what is installed")
    parser.add_argument("--corpus-only", action="store_true", help="skip tokenizer and tokens")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    recipe = tomllib.loads(args.recipe.read_text(encoding="utf-8"))
    if not args.skip_install:
        state: dict[str, bool] = {}
        for src in recipe["source"]:
            install_source(src["install"], args.cache / src["install"]["kind"], state)
    splits, stats = build_splits(recipe, args.cache, log)
    heldout = [s["name"] for s in recipe["source"] if s["role"] == "heldout"]
    checks = check_splits(splits, heldout)
    for split in SPLITS:
        rows = ({"source": d.source, "doc_id": d.doc_id, "text": d.text} for d in splits[split])
        atomic_write_jsonl(args.out / f"{split}.jsonl", rows)
    sample_sizes = write_samples(splits, recipe, args.package_dir)
    total = {s: sum(len(d.text.encode()) for d in splits[s]) for s in SPLITS}
    atomic_write_json(
        args.out / "sources.json",
        {
            "recipe": args.recipe.name,
            "recipe_sha256": hashlib.sha256(args.recipe.read_bytes()).hexdigest(),
            "seed": recipe["corpus"]["seed"],
            "heldout_sources": heldout,
            "bytes": total,
            "documents": {s: len(splits[s]) for s in SPLITS},
            "checks": checks,
            "samples_bytes": sample_sizes,
            "sources": stats,
        },
    )
    log(f"corpus bytes {total}; samples {sample_sizes}; checks {checks}")
    if args.corpus_only:
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_tokenizer import build_tokens

    build_tokens(args.out, args.tokenizer_dir, args.tokens_dir, args.package_dir, recipe, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
