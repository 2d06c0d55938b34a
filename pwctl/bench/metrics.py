"""LongBench v1 metrics, scored the way THUDM/LongBench's `metrics.py` and `eval.py` score them
and with the libraries they use: `rouge` (ROUGE-L), `jieba` (Chinese words) and `fuzzywuzzy`
(code similarity), so that a score printed here is the number papers print.

Details of the reference that decide scores, and how we keep them:
- code_sim: fuzzywuzzy's `fuzz.ratio` on difflib's SequenceMatcher, which is what fuzzywuzzy
  uses without python-Levenshtein and what the published figures were made with. With
  python-Levenshtein installed fuzzywuzzy switches matcher and code scores move, so we pin the
  ratio to difflib inside fuzzywuzzy's own guards (None, equal and empty strings) whatever is
  installed.
- rouge / rouge_zh: `Rouge().get_scores(...)["rouge-l"]["f"]`, the package's summary-level
  union LCS over sentences split at "." (rouge_zh: jieba words joined by spaces). Whatever the
  package raises scores 0, as the reference's bare `except` does. That includes RecursionError:
  rouge rebuilds each LCS recursively, a frame per word, so a sentence pair of ~1000 words
  fails under eval.py. We give the package the recursion depth it had there (`_rouge_l`), so
  such pairs score 0 here too, however deep our caller is.
- classification: the reference drops matches that lie inside the gold class name while
  iterating over the same list, so the match right after each dropped one is never checked
  ("Human" dropped for gold "Human being" shields the next match). We keep that.
- the first line only for trec, triviaqa, samsum and lsht; the best score over the gold
  answers; 100 x the mean, rounded to 2 decimals, per task and per LongBench-E length bucket.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import jieba
from fuzzywuzzy import utils as fuzz_utils
from rouge import Rouge

jieba.setLogLevel(logging.WARNING)  # not "Building prefix dict ..." on every first use

# dataset -> (metric name, max new tokens): LongBench v1's dataset2metric and
# config/dataset2maxlen.json.
TASKS: dict[str, tuple[str, int]] = {
    "narrativeqa": ("qa_f1", 128),
    "qasper": ("qa_f1", 128),
    "multifieldqa_en": ("qa_f1", 64),
    "multifieldqa_zh": ("qa_f1_zh", 64),
    "hotpotqa": ("qa_f1", 32),
    "2wikimqa": ("qa_f1", 32),
    "musique": ("qa_f1", 32),
    "dureader": ("rouge_zh", 128),
    "gov_report": ("rouge", 512),
    "qmsum": ("rouge", 512),
    "multi_news": ("rouge", 512),
    "vcsum": ("rouge_zh", 512),
    "trec": ("classification", 64),
    "triviaqa": ("qa_f1", 32),
    "samsum": ("rouge", 128),
    "lsht": ("classification", 64),
    "passage_count": ("count", 32),
    "passage_retrieval_en": ("retrieval", 32),
    "passage_retrieval_zh": ("retrieval_zh", 32),
    "lcc": ("code_sim", 64),
    "repobench-p": ("code_sim", 64),
}
CATEGORIES: dict[str, tuple[str, ...]] = {
    "single-doc QA": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "multi-doc QA": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "few-shot": ("trec", "triviaqa", "samsum", "lsht"),
    "synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "code": ("lcc", "repobench-p"),
}
# Few-shot tasks continue a pattern of lines: only the first generated line is the answer.
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
# LongBench-E's length buckets (eval.py scorer_e): words (English) or characters (Chinese).
LENGTH_BUCKETS: tuple[tuple[str, float], ...] = (("0-4k", 4000), ("4-8k", 8000), ("8k+", 1e300))

ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ALL_PUNCT = frozenset(string.punctuation + ZH_PUNCTUATION)
_EN_PUNCT = frozenset(string.punctuation)

# How many nested Python calls rouge could make below LongBench's call into it: a probe standing
# in for Rouge.get_scores under eval.py's scorer (CPython 3.11, its default recursion limit),
# called as eval.py calls scorer, from module level.
REFERENCE_LEVELS = {"rouge": 996, "rouge_zh": 995}


def normalize_answer(s: str) -> str:
    """SQuAD: lowercase, drop punctuation, drop articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _EN_PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh(s: str) -> str:
    """Lowercase, drop Chinese and ASCII punctuation and every whitespace."""
    return "".join(ch for ch in s.lower() if ch not in _ALL_PUNCT and not ch.isspace())


def zh_words(s: str) -> list[str]:
    """jieba's words in its default (accurate, HMM) mode, as the reference cuts them."""
    return list(jieba.cut(s, cut_all=False))


def token_f1(pred: Sequence[str], gold: Sequence[str]) -> float:
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def qa_f1(pred: str, gold: str, **_: object) -> float:
    return token_f1(normalize_answer(pred).split(), normalize_answer(gold).split())


def qa_f1_zh(pred: str, gold: str, **_: object) -> float:
    def words(s: str) -> list[str]:
        return [w for w in map(normalize_zh, zh_words(s)) if w]

    return token_f1(words(pred), words(gold))


def _dive(n: int) -> int:
    try:
        return _dive(n + 1)
    except RecursionError:
        return n


def _levels_left() -> int:
    """Nested Python calls that fit under the recursion limit below this call (the probe
    REFERENCE_LEVELS was measured with; hidden C-level entries below us count too)."""
    return _dive(1)


@contextmanager
def _recursion_limit(limit: int) -> Iterator[None]:
    """The recursion limit is process-wide: bench scores in one thread, and we put it back."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def _rouge_l(pred: str, gold: str, metric: str) -> float:
    # as deep as rouge could recurse under eval.py, however deep our caller is
    limit = sys.getrecursionlimit() + REFERENCE_LEVELS[metric] - _levels_left()
    with _recursion_limit(limit):
        try:
            scores = Rouge().get_scores([pred], [gold], avg=True)
        except Exception:  # the reference scores any failure 0 (empty text, recursion)
            return 0.0
    return float(scores["rouge-l"]["f"])


def rouge(pred: str, gold: str, **_: object) -> float:
    return _rouge_l(pred, gold, "rouge")


def rouge_zh(pred: str, gold: str, **_: object) -> float:
    return _rouge_l(" ".join(zh_words(pred)), " ".join(zh_words(gold)), "rouge_zh")


def classification(pred: str, gold: str, all_classes: Sequence[str] | None = None) -> float:
    matches = [c for c in all_classes or () if c in pred]
    i = 0
    while i < len(matches):
        if matches[i] in gold and matches[i] != gold:
            matches.remove(matches[i])
        # after a removal this steps over the match that slid into place, as the reference's
        # removal inside a for loop over the same list does
        i += 1
    return 1.0 / len(matches) if gold in matches else 0.0


def _share_equal(pred: str, target: str) -> float:
    numbers = re.findall(r"\d+", pred)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def count(pred: str, gold: str, **_: object) -> float:
    return _share_equal(pred, str(gold))


def retrieval(pred: str, gold: str, **_: object) -> float:
    m = re.search(r"Paragraph (\d+)", gold)
    return _share_equal(pred, m.group(1)) if m else 0.0


def retrieval_zh(pred: str, gold: str, **_: object) -> float:
    m = re.search(r"段落(\d+)", gold)
    return _share_equal(pred, m.group(1)) if m else 0.0


@fuzz_utils.check_for_none
@fuzz_utils.check_for_equivalence
@fuzz_utils.check_empty_string
def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's `fuzz.ratio` with difflib's matcher (fuzzywuzzy without python-Levenshtein):
    equal strings 100 (two empty ones too), one empty 0."""
    return fuzz_utils.intr(100 * difflib.SequenceMatcher(None, a, b).ratio())


def code_sim(pred: str, gold: str, **_: object) -> float:
    # The first line that is code, not a fence or a comment, is the completion.
    lines = pred.lstrip("\n").split("\n")
    line = next((x for x in lines if "`" not in x and "#" not in x and "//" not in x), "")
    return fuzz_ratio(line, gold) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge": rouge,
    "rouge_zh": rouge_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
}


def score_example(
    dataset: str, pred: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """One prediction in [0, 1]: the best over the gold answers."""
    metric = METRICS[TASKS[dataset][0]]
    if dataset in FIRST_LINE:
        pred = pred.lstrip("\n").split("\n")[0]
    return max((metric(pred, str(g), all_classes=all_classes) for g in answers), default=0.0)


def task_score(per_example: Sequence[float]) -> float:
    """LongBench's task score: 100 x mean, rounded to 2 decimals."""
    return round(100 * sum(per_example) / len(per_example), 2) if per_example else 0.0


def length_bucket(length: int) -> str:
    """LongBench-E's bucket of an example's `length`."""
    return next(name for name, below in LENGTH_BUCKETS if length < below)


def bucket_scores(per_example: Sequence[float], lengths: Sequence[int]) -> dict[str, float]:
    """Task score within each LongBench-E length bucket that has examples."""
    groups: dict[str, list[float]] = {name: [] for name, _ in LENGTH_BUCKETS}
    for score, length in zip(per_example, lengths, strict=True):
        groups[length_bucket(length)].append(score)
    return {name: task_score(v) for name, v in groups.items() if v}


def mean_of(scores: Sequence[float]) -> float:
    return round(sum(scores) / len(scores), 2) if scores else 0.0


def category_averages(scores: dict[str, float]) -> dict[str, float]:
    """Mean task score of each category that has at least one scored task."""
    out = {}
    for cat, tasks in CATEGORIES.items():
        have = [scores[t] for t in tasks if t in scores]
        if have:
            out[cat] = mean_of(have)
    return out
