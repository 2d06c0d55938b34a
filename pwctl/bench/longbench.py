"""`pwctl bench --longbench` / `--predictions`: LongBench v1 from local jsonl files, scored with
LongBench's metrics (pwctl/bench/metrics.py).

A folder holds one `<task>.jsonl` per task (LongBench-E's `<task>_e.jsonl` too), one example a
line with the fields input, context, answers, length, dataset, language, all_classes, _id. Each
example becomes a prompt from its task's template, cut from the middle to fit the model's
context less the task's max new tokens, wrapped in the tokenizer's chat template where the task
wants one, and continued greedily."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pwctl.bench.metrics import FIRST_LINE, TASKS, category_averages, score_example, task_score
from pwctl.errors import PwctlError
from pwctl.policy import Policy
from pwctl.runtime.engine import Engine

FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")
PRED_FIELDS = ("dataset", "pred", "answers")
# Few-shot and code tasks continue a raw pattern; a chat wrapper would break it.
NO_CHAT = FIRST_LINE | {"lcc", "repobench-p"}

_QA = "Answer the question from the {doc} below, as briefly as you can, with no explanation.\n\n"
PROMPTS: dict[str, str] = {
    "narrativeqa": _QA.format(doc="story") + "Story: {context}\n\nQuestion: {input}\n\nAnswer:",
    "qasper": _QA.format(doc="scientific article")
    + 'If it cannot be answered, write "unanswerable"; if it is a yes/no question, write "yes",'
    ' "no" or "unanswerable".\n\nArticle: {context}\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": _QA.format(doc="text") + "{context}\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答问题，不要解释。\n\n"
    "{context}\n\n问题：{input}\n回答：",
    "hotpotqa": _QA.format(doc="passages") + "{context}\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": _QA.format(doc="passages") + "{context}\n\nQuestion: {input}\nAnswer:",
    "musique": _QA.format(doc="passages") + "{context}\n\nQuestion: {input}\nAnswer:",
    "dureader": "请根据以下文章简短回答问题。\n\n{context}\n\n问题：{input}\n回答：",
    "gov_report": "Write a one-page summary of the report below.\n\nReport:\n{context}\n\nSummary:",
    "qmsum": "Answer the query about the meeting transcript below in one or more sentences.\n\n"
    "Transcript:\n{context}\n\nQuery: {input}\nAnswer:",
    "multi_news": "Write a one-page summary of the news articles below.\n\n{context}\n\nSummary:",
    "vcsum": "请用一段话总结下面的会议记录。\n\n{context}\n\n总结：",
    "trec": "Give the type of the question, following the examples.\n\n{context}\n{input}",
    "triviaqa": "Answer the question from the passage, following the examples.\n\n"
    "{context}\n\n{input}",
    "samsum": "Summarize the dialogue, following the examples.\n\n{context}\n\n{input}",
    "lsht": "请判断新闻的类别，参照下面的例子。\n\n{context}\n{input}",
    "passage_count": "Below are several paragraphs, some of them repeated. How many distinct "
    "paragraphs are there?\n\n{context}\n\nAnswer with one number only.\nThe answer is: ",
    "passage_retrieval_en": "Below are 30 paragraphs and a summary of one of them. Which "
    'paragraph is it?\n\n{context}\n\nSummary: {input}\n\nAnswer like "Paragraph 1".\n'
    "The answer is: ",
    "passage_retrieval_zh": "以下是若干段落和其中一段的摘要，请指出摘要来自哪一段。\n\n"
    "{context}\n\n"
    '摘要：{input}\n\n请用"段落1"这样的格式回答。\n答案是：',
    "lcc": "Complete the code.\n{context}Next line of code:\n",
    "repobench-p": "Complete the code.\n{context}{input}Next line of code:\n",
}


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


@dataclass
class LongBenchResult:
    policy: str
    scores: dict[str, float]  # task -> 100 x mean score
    categories: dict[str, float]
    average: float  # mean over tasks
    examples: dict[str, int]
    predictions: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def base_task(name: str) -> str:
    """hotpotqa_e (LongBench-E) -> hotpotqa; unknown names are an error."""
    base = name if name in TASKS else name.removesuffix("_e")
    if base not in TASKS:
        raise PwctlError(f"unknown LongBench task '{name}'; tasks: {', '.join(TASKS)}")
    return base


def _records(path: Path, required: Sequence[str]) -> Iterable[tuple[int, dict]]:
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PwctlError(f"{path}:{n}: not a JSON line ({e.msg})") from None
            if not isinstance(rec, dict):
                raise PwctlError(f"{path}:{n}: expected a JSON object")
            missing = [f for f in required if f not in rec]
            if missing:
                raise PwctlError(f"{path}:{n}: missing field(s) {', '.join(missing)}")
            if not isinstance(rec["answers"], list) or not rec["answers"]:
                raise PwctlError(f"{path}:{n}: 'answers' must be a non-empty list")
            classes = rec.get("all_classes")
            if classes is not None and not isinstance(classes, list):
                raise PwctlError(f"{path}:{n}: 'all_classes' must be a list or null")
            yield n, rec


def load_task(folder: Path, task: str, limit: int | None = None) -> list[LongBenchExample]:
    base = base_task(task)
    if not folder.is_dir():
        raise PwctlError(f"{folder}: LongBench folder not found")
    path = folder / f"{task}.jsonl"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in folder.glob("*.jsonl"))) or "none"
        raise PwctlError(f"{path}: no such task file (tasks here: {have})")
    out = []
    for _, r in _records(path, FIELDS):
        out.append(
            LongBenchExample(
                base,
                str(r["input"]),
                str(r["context"]),
                [str(a) for a in r["answers"]],
                r["all_classes"],
                int(r.get("length") or 0),
                str(r.get("language") or "en"),
                str(r.get("_id", "")),
            )
        )
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise PwctlError(f"{path}: no examples")
    return out


def available_tasks(folder: Path) -> list[str]:
    """The LongBench task files in a folder, in LongBench's order."""
    if not folder.is_dir():
        raise PwctlError(f"{folder}: LongBench folder not found")
    stems = {p.stem for p in folder.glob("*.jsonl")}
    found = [t for t in TASKS if t in stems] + [f"{t}_e" for t in TASKS if f"{t}_e" in stems]
    if not found:
        raise PwctlError(f"{folder}: no LongBench task files (<task>.jsonl)")
    return found


def middle_truncate(ids: list[int], budget: int) -> list[int]:
    """Keep the first and last halves of the budget: instructions open a prompt, the
    question closes it, and both matter more than the middle of the context."""
    if len(ids) <= budget:
        return ids
    half = budget // 2
    return ids[:half] + ids[len(ids) - (budget - half) :]


def encode_prompt(tokenizer, prompt: str, task: str, budget: int) -> list[int]:
    """Token ids of one prompt, at most `budget` long, chat-wrapped unless the task is raw."""
    ids = tokenizer(prompt).input_ids
    chat = base_task(task) not in NO_CHAT and getattr(tokenizer, "chat_template", None)
    if not chat:
        return middle_truncate(ids, budget)

    def wrap(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template spells out BOS and role markers itself.
        return tokenizer(text, add_special_tokens=False).input_ids

    overhead = len(wrap(""))
    if len(ids) + overhead > budget:
        cut = middle_truncate(ids, max(1, budget - overhead))
        prompt = tokenizer.decode(cut, skip_special_tokens=True)
    return middle_truncate(wrap(prompt), budget)  # re-tokenizing may add a token or two


def score_predictions(records: Iterable[dict]) -> dict[str, list[float]]:
    """Per-example scores grouped by task."""
    out: dict[str, list[float]] = {}
    for r in records:
        task = base_task(r["dataset"])
        s = score_example(
            task, str(r["pred"]), [str(a) for a in r["answers"]], r.get("all_classes")
        )
        out.setdefault(r["dataset"], []).append(s)
    return out


def summarize(
    policy: str, per_example: dict[str, list[float]], preds: list[dict]
) -> LongBenchResult:
    scores = {t: task_score(v) for t, v in per_example.items()}
    by_base = {base_task(t): s for t, s in scores.items()}
    avg = round(sum(scores.values()) / len(scores), 2) if scores else 0.0
    counts = {t: len(v) for t, v in per_example.items()}
    return LongBenchResult(policy, scores, category_averages(by_base), avg, counts, preds)


def load_predictions(path: Path) -> dict[str, list[dict]]:
    """A predictions jsonl (dataset, pred, answers, all_classes; optional policy), or a folder of
    LongBench's per-task `<task>.jsonl` prediction files (the dataset is the file's name)."""
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise PwctlError(f"{path}: no .jsonl prediction files")
    elif path.is_file():
        files = [path]
    else:
        raise PwctlError(f"{path}: predictions file not found")
    groups: dict[str, list[dict]] = {}
    for f in files:
        need = PRED_FIELDS if f is path else PRED_FIELDS[1:]
        for n, r in _records(f, need):
            r.setdefault("dataset", f.stem)
            try:
                base_task(r["dataset"])
            except PwctlError as e:
                raise PwctlError(f"{f}:{n}: {e}") from None
            groups.setdefault(str(r.get("policy", "predictions")), []).append(r)
    if not groups:
        raise PwctlError(f"{path}: no predictions")
    return groups


def run_predictions(path: Path) -> list[LongBenchResult]:
    return [summarize(p, score_predictions(rs), []) for p, rs in load_predictions(path).items()]


def run_longbench(
    engine: Engine,
    folder: Path,
    policies: Sequence[Policy],
    tasks: Sequence[str] | None = None,
    limit: int | None = None,
    context: int | None = None,
    max_new_tokens: int | None = None,
) -> list[LongBenchResult]:
    """Generate and score every example of each task under each policy. `limit` caps examples
    per task, `context` overrides the model's context length and `max_new_tokens` caps each
    task's generation length (all three for quick runs; published numbers use none)."""
    names = list(tasks) if tasks else available_tasks(folder)
    data = {t: load_task(folder, t, limit) for t in names}
    context = context or getattr(engine.model.config, "max_position_embeddings", None)
    if not context:
        raise PwctlError("the model config has no max_position_embeddings; pass a context length")
    prompts = {}
    for t, exs in data.items():
        new = min(TASKS[base_task(t)][1], max_new_tokens or 1 << 30)
        if context - new < 16:
            raise PwctlError(f"context {context} leaves no room for {t}'s prompt")
        template = PROMPTS[base_task(t)]
        prompts[t] = [
            (encode_prompt(engine.tokenizer, template.format(**asdict(e)), t, context - new), new)
            for e in exs
        ]
    results = []
    engine.reset_policies()  # budgeted policies start from the profile, not an earlier run
    for p in policies:
        engine.set_policy(p)
        preds = []
        for t, exs in data.items():
            for e, (ids, new) in zip(exs, prompts[t], strict=True):
                out = engine.generate_ids(ids, new)
                text = engine.tokenizer.decode(out, skip_special_tokens=True)
                preds.append(
                    dict(dataset=t, pred=text, answers=e.answers, all_classes=e.all_classes,
                         length=e.length, _id=e.id, policy=str(p))
                )  # fmt: skip
        results.append(summarize(str(p), score_predictions(preds), preds))
    return results


def table(results: Sequence[LongBenchResult]) -> tuple[list[str], list[list]]:
    """Columns and rows of the report: a row per task, then per category, then the average;
    a column per policy."""
    columns = ["task", *(r.policy for r in results)]
    tasks = list(dict.fromkeys(t for r in results for t in r.scores))
    cats = list(dict.fromkeys(c for r in results for c in r.categories))
    rows = [[f"{t} ({results[0].examples.get(t, 0)})", *(r.scores.get(t, "-") for r in results)]
            for t in tasks]  # fmt: skip
    rows += [[f"category: {c}", *(r.categories.get(c, "-") for r in results)] for c in cats]
    rows.append(["average", *(r.average for r in results)])
    return columns, rows
