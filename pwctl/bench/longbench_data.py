"""LongBench's released data from a local folder, read through `datasets.load_dataset` with the
Hugging Face Hub switched off before `datasets` is imported: never the network.

A folder (or its `data/` subfolder, or a Hugging Face cache folder's newest snapshot) holds one
of these layouts:
- `<task>.jsonl` files: LongBench's data.zip unpacked (LongBench-E's are `<task>_e.jsonl`);
- a parquet copy: `<task>.parquet`, or `<task>/**/*.parquet` (the Hub's parquet conversion keeps
  a folder per task);
- `data.zip` itself, as LongBench ships it and as a cache snapshot of THUDM/LongBench holds it:
  its `data/<task>.jsonl` members are unpacked to a temporary folder and read from there.
Every record has LongBench's fields: input, context, answers, length, dataset, language,
all_classes, _id."""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from pwctl.bench.metrics import TASKS
from pwctl.errors import PwctlError

FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
LAYOUT = (
    "expected LongBench's released data in the folder or its data/ subfolder: <task>.jsonl "
    "files (data.zip unpacked: hotpotqa.jsonl, hotpotqa_e.jsonl, ...), a parquet copy "
    "(<task>.parquet or <task>/**/*.parquet), or data.zip itself (also inside a Hugging Face "
    "cache folder's snapshots/<rev>/)"
)


@dataclass
class LongBenchExample:
    dataset: str  # the task, as named by its file (metric and template follow it)
    input: str
    context: str
    answers: list[str]
    all_classes: list[str] | None = None
    length: int = 0
    language: str = "en"
    id: str = ""


@dataclass(frozen=True)
class TaskSource:
    """Where one task's records are: files `datasets` reads (`kind`: json or parquet), or a
    member of a zip archive."""

    name: str
    kind: str
    files: tuple[str, ...]
    archive: Path | None = None

    @property
    def origin(self) -> str:
        return f"{self.archive}:{self.files[0]}" if self.archive else self.files[0]


def base_task(name: str) -> str:
    """hotpotqa_e (LongBench-E) -> hotpotqa; unknown names are an error."""
    base = name if name in TASKS else name.removesuffix("_e")
    if base not in TASKS:
        raise PwctlError(f"unknown LongBench task '{name}'; tasks: {', '.join(TASKS)}")
    return base


def is_task(name: str) -> bool:
    return name in TASKS or name.removesuffix("_e") in TASKS


def offline_datasets() -> ModuleType:
    """`datasets` with the Hub off. The environment is read when `datasets` is first imported;
    if something imported it before us, its config is switched off too."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.disable_progress_bars()
    return datasets


def find_sources(folder: Path) -> dict[str, TaskSource]:
    """Every LongBench task file in `folder`, in LongBench's order (LongBench-E's after)."""
    if not folder.is_dir():
        raise PwctlError(f"{folder}: LongBench folder not found; {LAYOUT}")
    for root in (folder, folder / "data", *_snapshots(folder)):
        found = _jsonl(root) or _parquet(root) or _archive(root)
        if found:
            order = [*TASKS, *(f"{t}_e" for t in TASKS)]
            return {t: found[t] for t in order if t in found}
    raise PwctlError(f"{folder}: no LongBench task files; {LAYOUT}")


def available_tasks(folder: Path) -> list[str]:
    return list(find_sources(folder))


def load_task(
    folder: Path, task: str, limit: int | None = None, cache_dir: Path | None = None
) -> list[LongBenchExample]:
    """The first `limit` examples (all: None) of one task file."""
    base = base_task(task)
    sources = find_sources(folder)
    if task not in sources:
        have = ", ".join(sources)
        raise PwctlError(f"{folder}: no {task} file (tasks here: {have}); {LAYOUT}")
    source = sources[task]
    records = _read(source, limit, cache_dir)
    if not records:
        raise PwctlError(f"{source.origin}: no examples")
    return [_example(base, source, n, r) for n, r in enumerate(records, 1)]


def _snapshots(folder: Path) -> list[Path]:
    """A Hugging Face cache folder (datasets--THUDM--LongBench): the snapshot refs/main names,
    else the newest."""
    snaps = [p for p in (folder / "snapshots").glob("*") if p.is_dir()]
    main = folder / "refs" / "main"
    if main.is_file() and (folder / "snapshots" / main.read_text().strip()).is_dir():
        return [folder / "snapshots" / main.read_text().strip()]
    return sorted(snaps, key=lambda p: p.stat().st_mtime, reverse=True)[:1]


def _jsonl(root: Path) -> dict[str, TaskSource]:
    return {
        p.stem: TaskSource(p.stem, "json", (str(p),))
        for p in sorted(root.glob("*.jsonl"))
        if is_task(p.stem)
    }


def _parquet(root: Path) -> dict[str, TaskSource]:
    out = {}
    for p in sorted(root.glob("*")):
        name = p.name.removesuffix(".parquet")
        if not is_task(name):
            continue
        files = [p] if p.is_file() and p.suffix == ".parquet" else sorted(p.rglob("*.parquet"))
        if files:
            out[name] = TaskSource(name, "parquet", tuple(str(f) for f in files))
    return out


def _archive(root: Path) -> dict[str, TaskSource]:
    path = root / "data.zip"
    if not path.is_file():
        return {}
    try:
        with zipfile.ZipFile(path) as z:
            members = z.namelist()
    except zipfile.BadZipFile:
        raise PwctlError(f"{path}: not a zip archive; {LAYOUT}") from None
    out = {}
    for m in members:
        name = Path(m).name.removesuffix(".jsonl")
        if m.endswith(".jsonl") and is_task(name):
            out[name] = TaskSource(name, "json", (m,), path)
    return out


@contextmanager
def _local_files(source: TaskSource) -> Iterator[tuple[list[str], str | None]]:
    """The files to read and the cache folder to read them into: an archive member is unpacked
    into a temporary folder, and its cache goes there too (nothing of it stays behind)."""
    if source.archive is None:
        yield list(source.files), None
        return
    with tempfile.TemporaryDirectory(prefix="pwctl-longbench-") as tmp:
        with zipfile.ZipFile(source.archive) as z:
            path = z.extract(source.files[0], tmp)
        yield [path], str(Path(tmp) / "cache")


def _read(source: TaskSource, limit: int | None, cache_dir: Path | None) -> list[dict[str, Any]]:
    ds = offline_datasets()
    with _local_files(source) as (files, tmp_cache):
        if all(Path(f).stat().st_size == 0 for f in files):
            return []  # datasets has no schema to infer from an empty file
        try:
            data = ds.load_dataset(
                source.kind, data_files={"test": files}, split="test",
                cache_dir=tmp_cache or (str(cache_dir) if cache_dir else None),
            )  # fmt: skip
        except Exception as e:  # datasets wraps JSON and Arrow errors in its own types
            cause = str(e.__cause__ or e).strip().splitlines()
            why = cause[0] if cause else type(e).__name__
            raise PwctlError(
                f"{source.origin}: not LongBench {source.kind} ({why}); {LAYOUT}"
            ) from None
        missing = [f for f in FIELDS if f not in data.column_names]
        if missing:
            raise PwctlError(
                f"{source.origin}: missing field(s) {', '.join(missing)}; LongBench's records "
                f"have {', '.join(FIELDS)}"
            )
        if limit is not None:
            data = data.select(range(min(limit, len(data))))
        return data.to_list()  # read while an unpacked archive member is still there


def _example(task: str, source: TaskSource, n: int, r: dict[str, Any]) -> LongBenchExample:
    where = f"{source.origin}: example {n}"
    answers, classes = r["answers"], r["all_classes"]
    if not isinstance(answers, list) or not answers:
        raise PwctlError(f"{where}: 'answers' must be a non-empty list")
    if classes is not None and not isinstance(classes, list):
        raise PwctlError(f"{where}: 'all_classes' must be a list or null")
    return LongBenchExample(
        task,
        str(r["input"]),
        str(r["context"]),
        [str(a) for a in answers],
        classes,
        int(r["length"] or 0),
        str(r["language"] or "en"),
        str(r["_id"] or ""),
    )
