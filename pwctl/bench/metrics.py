"""LongBench v1 metrics (THUDM/LongBench `metrics.py` / `eval.py`), re-implemented without
its dependencies so that scores of our runs and of other systems' predictions come out alike.

Where we differ from the reference, and why:
- rouge / rouge_zh: ROUGE-L F1 of whitespace tokens from the longest common subsequence, written
  here (the `rouge` package also splits sentences on "." and uses its own F weighting, so
  scores can differ by a little on multi-sentence summaries). Empty text scores 0, as the
  package's exception does.
- qa_f1_zh / rouge_zh: one token per CJK character and one per run of Latin letters or digits,
  instead of jieba words (no dependency); scores are comparable among our runs, not to papers.
- code_sim: fuzzywuzzy's ratio is round(100 * difflib.SequenceMatcher.ratio()) when
  python-Levenshtein is absent; we use exactly that.
- classification: matches that are substrings of the gold but not equal to it are dropped all
  at once (the reference removes them while iterating the same list, which can skip one).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

# dataset -> (metric name, max new tokens), LongBench v1's dataset2metric / dataset2maxlen.
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

ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ALL_PUNCT = frozenset(string.punctuation + ZH_PUNCTUATION)
_ZH_TOKEN = re.compile(r"[A-Za-z0-9]+|[^\sA-Za-z0-9]")


def normalize_answer(s: str) -> str:
    """SQuAD: lowercase, drop punctuation, drop articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in string.punctuation)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def zh_tokens(s: str) -> list[str]:
    """Per-character tokens for CJK (no jieba), whole runs for Latin words and numbers."""
    return _ZH_TOKEN.findall(s)


def token_f1(pred: Sequence[str], gold: Sequence[str]) -> float:
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def qa_f1(pred: str, gold: str, **_: object) -> float:
    return token_f1(normalize_answer(pred).split(), normalize_answer(gold).split())


def qa_f1_zh(pred: str, gold: str, **_: object) -> float:
    def toks(s: str) -> list[str]:
        kept = ("".join(c for c in t.lower() if c not in _ALL_PUNCT) for t in zh_tokens(s))
        return [t for t in kept if t]

    return token_f1(toks(pred), toks(gold))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Longest common subsequence, one row of the DP table at a time."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(pred: Sequence[str], gold: Sequence[str]) -> float:
    """ROUGE-L F1 = 2PR / (P + R) with P = LCS / |pred|, R = LCS / |gold|."""
    if not pred or not gold:
        return 0.0
    lcs = lcs_length(pred, gold)
    return 0.0 if lcs == 0 else 2 * lcs / (len(pred) + len(gold))


def rouge(pred: str, gold: str, **_: object) -> float:
    return rouge_l(pred.split(), gold.split())


def rouge_zh(pred: str, gold: str, **_: object) -> float:
    return rouge_l(zh_tokens(pred), zh_tokens(gold))


def classification(pred: str, gold: str, all_classes: Sequence[str] | None = None) -> float:
    matches = [c for c in all_classes or () if c in pred]
    # "Entity" inside a gold "Entity type" would otherwise dilute a right answer.
    matches = [c for c in matches if not (c in gold and c != gold)]
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


def code_sim(pred: str, gold: str, **_: object) -> float:
    # The first line that is code, not a fence or a comment, is the completion.
    lines = pred.lstrip("\n").split("\n")
    line = next((x for x in lines if "`" not in x and "#" not in x and "//" not in x), "")
    if not line or not gold:
        return 0.0
    return round(100 * difflib.SequenceMatcher(None, line, gold).ratio()) / 100


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


def category_averages(scores: dict[str, float]) -> dict[str, float]:
    """Mean task score of each category that has at least one scored task."""
    out = {}
    for cat, tasks in CATEGORIES.items():
        have = [scores[t] for t in tasks if t in scores]
        if have:
            out[cat] = round(sum(have) / len(have), 2)
    return out
