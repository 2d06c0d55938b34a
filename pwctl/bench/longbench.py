"""`pwctl bench --longbench` / `--predictions`: LongBench v1 as its users run it, scored with its
own metrics (pwctl/bench/metrics.py).

Data: LongBench's released files from a local folder, read with `datasets` offline
(pwctl/bench/longbench_data.py). Prompts: LongBench's templates (config/dataset2prompt.json at
THUDM/LongBench commit 8ae23fd4) and generation lengths (config/dataset2maxlen.json); a prompt
longer than the model's context less the task's generation length is cut in the middle, as
LongBench's pred.py does (we keep token ids; pred.py decodes the two halves and re-tokenizes).
Chat-tuned tokenizers wrap the prompt in their chat template, except for the few-shot and code
tasks (pred.py's rule); samsum's answer ends at its first newline (pred.py stops there).

Runs: every policy on the continuous-batching engine `serve` uses, under one memory budget
(pwctl/bench/longctx.py); each result carries the memory it was obtained at.

Predictions: LongBench's format (pred.py writes `pred`, `answers`, `all_classes`, `length`, one
`<task>.jsonl` a task and a folder a model), and pwctl's (the same with `dataset`, `policy` and
`_id` on every line, in one file)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pwctl.bench.longbench_data import (
    LongBenchExample,
    available_tasks,
    base_task,
    find_sources,
    is_task,
    load_task,
)
from pwctl.bench.longctx import EngineFor, MemoryReport, Request, RunSpec, engine_for, run_policy
from pwctl.bench.metrics import (
    FIRST_LINE,
    LENGTH_BUCKETS,
    TASKS,
    bucket_scores,
    category_averages,
    mean_of,
    score_example,
    task_score,
)
from pwctl.errors import PwctlError
from pwctl.policy import Policy
from pwctl.runtime.engine.engine import Engine

# Few-shot and code tasks continue a raw pattern; a chat wrapper would break it (pred.py).
NO_CHAT = FIRST_LINE | {"lcc", "repobench-p"}
# pred.py stops samsum at a newline: the model would go on with the next example's dialogue.
STOP_AT_NEWLINE = frozenset({"samsum"})
# `--paper-tasks`: the paper's LongBench table used three tasks, which it does not name where we
# can read it; these are one each of single-doc QA, multi-doc QA and summarization, English,
# with LongBench-E files too (README: LongBench).
PAPER_TASKS = ("qasper", "hotpotqa", "gov_report")
PRED_FIELDS = ("pred", "answers")
LONGBENCH_PRED_FIELDS = ("pred", "answers", "all_classes", "length")

# LongBench's templates, character for character (config/dataset2prompt.json, commit 8ae23fd4).
PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie "
        "script, and a question. Answer the question as concisely as "
        "you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nStory: {context}\n\nNow, answer the question based "
        "on the story as concisely as you can, using a single phrase "
        "if possible. Do not provide any explanation.\n\nQuestion: {input}\n"
        "\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the "
        "question as concisely as you can, using a single phrase or sentence "
        "if possible. If the question cannot be answered based on the "
        'information in the article, write "unanswerable". If the question '
        'is a yes/no question, answer "yes", "no", or "unanswerable". '
        "Do not provide any explanation.\n\nArticle: {context}\n\n Answer "
        "the question based on the above article as concisely as you "
        "can, using a single phrase or sentence if possible. If the question "
        "cannot be answered based on the information in the article, "
        'write "unanswerable". If the question is a yes/no question, '
        'answer "yes", "no", or "unanswerable". Do not provide any explanation.\n'
        "\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, "
        "answer the following question based on the above text, only "
        "give me the answer and do not output any other words.\n\nQuestion: "
        "{input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n"
        "\n问题：{input}\n回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me "
        "the answer and do not output any other words.\n\nThe following "
        "are given passages.\n{context}\n\nAnswer the question based on "
        "the given passages. Only give me the answer and do not output "
        "any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me "
        "the answer and do not output any other words.\n\nThe following "
        "are given passages.\n{context}\n\nAnswer the question based on "
        "the given passages. Only give me the answer and do not output "
        "any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me "
        "the answer and do not output any other words.\n\nThe following "
        "are given passages.\n{context}\n\nAnswer the question based on "
        "the given passages. Only give me the answer and do not output "
        "any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page "
        "summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page "
        "summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a "
        "question or instruction. Answer the query in one or more sentences.\n"
        "\nTranscript:\n{context}\n\nNow, answer the query based on the above "
        "meeting transcript in one or more sentences.\n\nQuery: {input}\n"
        "Answer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary "
        "of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary "
        "of all the news.\n\nSummary:"
    ),
    "vcsum": (
        "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结："
    ),
    "trec": (
        "Please determine the type of the question below. Here are some "
        "examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me "
        "the answer and do not output any other words. The following "
        "are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following "
        "are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": ("请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}"),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some "
        "of them may be duplicates. Please carefully read these paragraphs "
        "and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs "
        "are there in total?\n\n{context}\n\nPlease enter the final count "
        "of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n"
        "\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. "
        "Please determine which paragraph the abstract is from.\n\n{context}\n"
        "\nThe following is an abstract.\n\n{input}\n\nPlease enter the number "
        "of the paragraph that the abstract is from. The answer format "
        'must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer '
        "is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n"
        '\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": ("Please complete the code given below. \n{context}Next line of code:\n"),
    "repobench-p": ("Please complete the code given below. \n{context}{input}Next line of code:\n"),
}


@dataclass
class LongBenchResult:
    policy: str
    scores: dict[str, float]  # task -> 100 x mean score
    categories: dict[str, float]
    average: float  # mean over tasks
    examples: dict[str, int]
    buckets: dict[str, dict[str, float]]  # task -> LongBench-E length bucket -> score
    bucket_averages: dict[str, float]  # bucket -> mean over the tasks that have it
    memory: MemoryReport | None = None  # what the scores were obtained at (runs, not files)
    predictions: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def paper_tasks(folder: Path) -> list[str]:
    """PAPER_TASKS as the folder has them: LongBench's files, else LongBench-E's."""
    have = find_sources(folder)
    return [t if t in have else f"{t}_e" for t in PAPER_TASKS]


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


def requests_for(
    tokenizer, data: dict[str, list[LongBenchExample]], context: int,
    max_new_tokens: int | None = None,
) -> list[Request]:  # fmt: skip
    """One request an example, task after task: its prompt fitted to the context less the
    task's generation length."""
    out = []
    for t, exs in data.items():
        base = base_task(t)
        new = min(TASKS[base][1], max_new_tokens or 1 << 30)
        if context - new < 16:
            raise PwctlError(f"context {context} leaves no room for {t}'s prompt")
        for e in exs:
            ids = encode_prompt(tokenizer, PROMPTS[base].format(**asdict(e)), t, context - new)
            out.append(Request(ids, new, first_line=base in STOP_AT_NEWLINE))
    return out


def run_longbench(
    engines: Engine | EngineFor,
    folder: Path,
    policies: Sequence[Policy],
    tasks: Sequence[str] | None = None,
    limit: int | None = None,
    context: int | None = None,
    max_new_tokens: int | None = None,
    spec: RunSpec | None = None,
    cache_dir: Path | None = None,
) -> list[LongBenchResult]:
    """Generate and score every example of each task under each policy, on the serving engine
    (`spec`: memory budget and batching). `limit` caps examples per task, `context` overrides
    the model's context length and `max_new_tokens` caps each task's generation length (all
    three for quick runs; published numbers use none)."""
    pick = engine_for(engines)
    names = list(tasks) if tasks else available_tasks(folder)
    data = {t: load_task(folder, t, limit, cache_dir) for t in names}
    first = pick(policies[0])
    context = context or getattr(first.model.config, "max_position_embeddings", None)
    if not context:
        raise PwctlError("the model config has no max_position_embeddings; pass a context length")
    requests = requests_for(first.tokenizer, data, context, max_new_tokens)
    # the engine serves the longest request there is (prompts are truncated to `context`), so
    # a memory budget need only hold that one at full length, not the model's whole context
    longest = max((len(q.ids) + q.max_new for q in requests), default=1)
    spec = replace(spec or RunSpec(), max_model_len=min(context, longest))
    examples = [e for exs in data.values() for e in exs]
    files = [t for t, exs in data.items() for _ in exs]
    results = []
    for p in policies:
        texts, memory = run_policy(pick(p), p, requests, spec)
        preds = [
            dict(dataset=t, pred=text, answers=e.answers, all_classes=e.all_classes,
                 length=e.length, _id=e.id, policy=str(p))
            for t, e, text in zip(files, examples, texts, strict=True)
        ]  # fmt: skip
        results.append(summarize(str(p), preds, memory))
    return results


def summarize(
    policy: str, records: Iterable[dict], memory: MemoryReport | None = None
) -> LongBenchResult:
    """Scores of prediction records (dataset, pred, answers, all_classes, length): per task,
    per category, per LongBench-E length bucket (tasks whose records all have a length)."""
    records = list(records)
    per_task: dict[str, list[dict]] = {}
    for r in sorted(records, key=lambda r: _task_order(r["dataset"])):
        per_task.setdefault(r["dataset"], []).append(r)
    scores, buckets = {}, {}
    for t, rs in per_task.items():
        per = [_score(r) for r in rs]
        scores[t] = task_score(per)
        if all(isinstance(r.get("length"), int) for r in rs):
            buckets[t] = bucket_scores(per, [r["length"] for r in rs])
    by_base = {base_task(t): s for t, s in scores.items()}
    bucket_avg = {
        name: mean_of([b[name] for b in buckets.values() if name in b])
        for name, _ in LENGTH_BUCKETS
        if any(name in b for b in buckets.values())
    }
    counts = {t: len(rs) for t, rs in per_task.items()}
    return LongBenchResult(
        policy, scores, category_averages(by_base), mean_of(list(scores.values())), counts,
        buckets, bucket_avg, memory, records,
    )  # fmt: skip


def _task_order(name: str) -> tuple[bool, int]:
    """LongBench's order, LongBench-E's files after."""
    return name not in TASKS, list(TASKS).index(base_task(name))


def _score(r: dict) -> float:
    answers = [str(a) for a in r["answers"]]
    return score_example(base_task(r["dataset"]), str(r["pred"]), answers, r.get("all_classes"))


# ----------------------------------------------------------------------------- predictions


def load_predictions(path: Path) -> dict[str, list[dict]]:
    """Prediction records by label. `path` is one jsonl (pwctl's: `dataset` and `policy` on
    each line; or one of LongBench's task files, named by its task), a folder of LongBench's
    `<task>.jsonl` files (pred.py's pred/<model>/; the label is the folder's name), or a folder
    of such folders (several models, or what --save-predictions wrote for several policies)."""
    if path.is_file():
        groups = [(path.parent.name if is_task(path.stem) else "predictions", [path])]
    elif path.is_dir():
        groups = _prediction_folders(path)
    else:
        raise PwctlError(f"{path}: predictions file not found")
    out: dict[str, list[dict]] = {}
    for label, files in groups:
        for f in files:
            for r in _prediction_records(f):
                out.setdefault(str(r.get("policy", label)), []).append(r)
    if not out:
        raise PwctlError(f"{path}: no predictions")
    return out


def _prediction_folders(path: Path) -> list[tuple[str, list[Path]]]:
    files = sorted(path.glob("*.jsonl"))
    if files:
        return [(path.name, files)]
    groups = [(d.name, sorted(d.glob("*.jsonl"))) for d in sorted(path.iterdir()) if d.is_dir()]
    groups = [(label, fs) for label, fs in groups if fs]
    if not groups:
        raise PwctlError(
            f"{path}: no .jsonl prediction files (LongBench's layout: <task>.jsonl files, "
            "or a folder of them per model)"
        )
    return groups


def _prediction_records(path: Path) -> Iterable[dict]:
    task = path.stem if is_task(path.stem) else None
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PwctlError(f"{where}: not a JSON line ({e.msg})") from None
            if not isinstance(rec, dict):
                raise PwctlError(f"{where}: expected a JSON object")
            missing = [f for f in PRED_FIELDS if f not in rec]
            if "dataset" not in rec and task is None:
                missing.append("dataset")  # nor is the file named after a task
            if missing:
                raise PwctlError(f"{where}: missing field(s) {', '.join(missing)}")
            if not isinstance(rec["answers"], list) or not rec["answers"]:
                raise PwctlError(f"{where}: 'answers' must be a non-empty list")
            rec.setdefault("dataset", task)
            try:
                base_task(rec["dataset"])
            except PwctlError as e:
                raise PwctlError(f"{where}: {e}") from None
            yield rec


def save_predictions(results: Sequence[LongBenchResult], path: Path) -> list[Path]:
    """A `.jsonl` path: one file, pwctl's format (LongBench's fields, plus dataset, policy and
    _id). Else a folder in LongBench's own layout: <path>/<policy>/<task>.jsonl, each line
    pred, answers, all_classes, length, as pred.py writes them. Returns the files written."""
    if path.suffix == ".jsonl":
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [_json_line(r) for res in results for r in res.predictions]
        path.write_text("".join(lines), encoding="utf-8")
        return [path]
    written = []
    for res in results:
        folder = path / res.policy.replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        by_task: dict[str, list[str]] = {}
        for r in res.predictions:
            own = {k: r[k] for k in LONGBENCH_PRED_FIELDS}
            by_task.setdefault(r["dataset"], []).append(_json_line(own))
        for task, lines in by_task.items():
            written.append(folder / f"{task}.jsonl")
            written[-1].write_text("".join(lines), encoding="utf-8")
    return written


def _json_line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


def run_predictions(path: Path) -> list[LongBenchResult]:
    return [summarize(label, rs) for label, rs in load_predictions(path).items()]


# ----------------------------------------------------------------------------- reports


def table(results: Sequence[LongBenchResult]) -> tuple[list[str], list[list]]:
    """Columns and rows of the score report: a row per task, then per category, per length
    bucket, then the average; a column per policy."""
    columns = ["task", *(r.policy for r in results)]
    tasks = list(dict.fromkeys(t for r in results for t in r.scores))
    cats = list(dict.fromkeys(c for r in results for c in r.categories))
    spans = list(dict.fromkeys(b for r in results for b in r.bucket_averages))
    rows = [[f"{t} ({results[0].examples.get(t, 0)})", *(r.scores.get(t, "-") for r in results)]
            for t in tasks]  # fmt: skip
    rows += [[f"category: {c}", *(r.categories.get(c, "-") for r in results)] for c in cats]
    rows += [[f"length {b}", *(r.bucket_averages.get(b, "-") for r in results)] for b in spans]
    rows.append(["average", *(r.average for r in results)])
    return columns, rows


def memory_points(results: Sequence[LongBenchResult]) -> list[tuple[str, float, MemoryReport]]:
    """(policy, average score, the memory it was obtained at) of each run."""
    return [(r.policy, r.average, r.memory) for r in results if r.memory is not None]


def report(data: Path, spec: RunSpec, results: Sequence[LongBenchResult]) -> dict[str, Any]:
    """The --json document."""
    return {"data": str(data), "spec": asdict(spec), "results": [r.as_dict() for r in results]}
