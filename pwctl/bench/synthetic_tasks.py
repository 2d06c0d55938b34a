"""`pwctl bench --synthetic`: pass key, needle-in-a-haystack and key-value retrieval prompts of an
exact token length, hidden in local prose, for models too small for LongBench.

Prompts are built in token space (prose tokenized once, facts spliced in at sentence starts) so
every prompt has exactly the requested length; the same seed gives the same prompts for every
policy and every run. A prompt counts as solved when the greedy continuation contains the
answer: the hidden number as a whole number (pass key, key-value) or the hidden phrase
(needle, case-insensitive).

Tasks: `passkey` (intro line, "The pass key is K. Remember it. K is the pass key."), `needle`
("The best thing to do in CITY is to ACTIVITY."), `kv` (four "The value for key K is V." facts,
the wording the bundled models were trained on) and `kv-ruler` (RULER's "One of the special
magic numbers for K is: V."). Filler is real prose, not repeated filler sentences.

Prompts run as LongBench's do (pwctl/bench/longctx.py): on the serving engine under one memory
budget, each policy's accuracy with the memory it was obtained at."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pwctl.bench.longctx import EngineFor, MemoryReport, Request, RunSpec, engine_for, run_policy
from pwctl.build.checkpoint import EVAL_SAMPLE
from pwctl.errors import PwctlError
from pwctl.policy import Policy
from pwctl.runtime.engine.engine import Engine

TASKS = ("passkey", "needle", "kv", "kv-ruler")
MAX_NEW = {"passkey": 12, "needle": 16, "kv": 12, "kv-ruler": 12}
KV_PAIRS = 4  # one queried pair and three distractors
CITIES = (
    "Lisbon", "Oslo", "Cairo", "Lima", "Dublin", "Kyoto", "Quebec", "Nairobi",
    "Vienna", "Hobart", "Tunis", "Bergen",
)  # fmt: skip
ACTIVITIES = (
    "walk along the old harbour", "eat bread by the river", "climb the north tower",
    "read in the public garden", "watch the boats at dawn", "visit the glass market",
    "swim in the cold lake", "listen to the bells at noon", "ride the hill tram",
    "sketch the stone bridge", "buy figs at the square", "sit under the great oak",
)  # fmt: skip
KEYS = (
    "amber", "basil", "cedar", "delta", "ember", "fable", "garnet", "harbor", "indigo",
    "juniper", "kettle", "lantern", "meadow", "nectar", "orchid", "pepper", "quartz",
    "raven", "saffron", "timber", "umber", "velvet", "willow", "zephyr",
)  # fmt: skip


@dataclass
class Prose:
    ids: np.ndarray  # the whole text as token ids
    starts: np.ndarray  # positions in ids where a sentence begins


@dataclass
class SyntheticExample:
    task: str
    length: int
    depth: float  # where the queried fact sits, as a fraction of the filler
    ids: list[int] = field(repr=False)
    answer: str


@dataclass
class SyntheticResult:
    policy: str
    accuracy: dict[str, dict[int, float]]  # task -> length -> share solved
    examples: list[dict]
    memory: MemoryReport | None = None  # what the accuracy was obtained at

    @property
    def mean_accuracy(self) -> float:
        """Share solved over every prompt."""
        return sum(x["solved"] for x in self.examples) / max(1, len(self.examples))

    def as_dict(self) -> dict:
        return asdict(self)


def load_prose(tokenizer, path: Path = EVAL_SAMPLE) -> Prose:
    if not path.is_file():
        raise PwctlError(f"{path}: prose file not found")
    text = path.read_text(errors="replace")
    ids = np.asarray(tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)
    if len(ids) < 64:
        raise PwctlError(f"{path}: {len(ids)} tokens, too little prose to hide facts in")
    # A token ending in . ! ? or a blank line closes a sentence; the next one opens another.
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    text_of = [tokenizer.convert_tokens_to_string([p]) if p else "" for p in pieces]
    ends = np.array([t.rstrip().endswith((".", "!", "?")) or t.endswith("\n\n") for t in text_of])
    starts = np.flatnonzero(ends[np.minimum(ids[:-1], len(ends) - 1)]) + 1
    return Prose(ids, starts)


def _parts(task: str, rng: np.random.Generator) -> tuple[str, list[str], str, str]:
    """Intro, facts (the queried one first), query and answer of one example, as text."""
    if task == "passkey":
        k = str(rng.integers(10000, 100000))
        fact = f" The pass key is {k}. Remember it. {k} is the pass key."
        intro = "There is a pass key hidden in the text below. Find it and remember it.\n\n"
        return intro, [fact], " What is the pass key? The pass key is", k
    if task == "needle":
        city, act = CITIES[rng.integers(len(CITIES))], ACTIVITIES[rng.integers(len(ACTIVITIES))]
        fact = f" The best thing to do in {city} is to {act}."
        query = f" What is the best thing to do in {city}? The best thing to do in {city} is to"
        return "", [fact], query, act
    if task in ("kv", "kv-ruler"):
        keys = rng.choice(KEYS, size=KV_PAIRS, replace=False)
        values = rng.integers(100000, 1000000, size=KV_PAIRS)
        if task == "kv":
            facts = [f" The value for key {k} is {v}." for k, v in zip(keys, values, strict=True)]
            query = f" What is the value for key {keys[0]}? The value for key {keys[0]} is"
            return "", facts, query, str(values[0])
        facts = [
            f" One of the special magic numbers for {k} is: {v}."
            for k, v in zip(keys, values, strict=True)
        ]
        query = f" What is the special magic number for {keys[0]}? The special magic number is"
        return "", facts, query, str(values[0])
    raise PwctlError(f"unknown synthetic task '{task}'; tasks: {', '.join(TASKS)}")


def _cut_at_sentence(prose: Prose, start: int, size: int, depth: float) -> int:
    """Offset into the filler nearest `depth` that begins a sentence (else the exact depth)."""
    target = round(depth * size)
    lo, hi = np.searchsorted(prose.starts, [start, start + size + 1])
    cands = prose.starts[lo:hi] - start
    return int(cands[np.abs(cands - target).argmin()]) if len(cands) else target


def make_examples(
    tokenizer,
    prose: Prose,
    task: str,
    length: int,
    n: int,
    seed: int = 0,
    depths: Sequence[float] | None = None,
) -> list[SyntheticExample]:
    """`n` prompts of exactly `length` tokens. Depths cycle through `depths`, or are spread
    evenly over (0, 1) by default; distractor facts go to random depths."""
    # Seeded per (task, length) so a prompt does not depend on which others were asked for.
    rng = np.random.default_rng([seed, TASKS.index(task) if task in TASKS else 99, length])
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    prefix = tokenizer("").input_ids  # BOS where the tokenizer adds one
    ids = (
        prose.ids
        if len(prose.ids) > 2 * length
        else np.tile(prose.ids, 2 * length // len(prose.ids) + 2)
    )
    out = []
    for i in range(n):
        depth = depths[i % len(depths)] if depths else (i + 0.5) / n
        intro, facts, query, answer = _parts(task, rng)
        fact_ids = [enc(f) for f in facts]
        head, tail = prefix + enc(intro), enc(query)
        size = length - len(head) - len(tail) - sum(map(len, fact_ids))
        if size < 8:
            raise PwctlError(f"--lengths {length}: too short for a {task} prompt")
        start = int(rng.integers(0, len(ids) - size))
        filler = ids[start : start + size].tolist()
        fact_depths = [depth, *rng.random(len(facts) - 1)]
        cuts = [_cut_at_sentence(prose, start, size, d) if ids is prose.ids else round(d * size)
                for d in fact_depths]  # fmt: skip
        body, prev = [], 0
        for cut, f in sorted(zip(cuts, fact_ids, strict=True), key=lambda cf: cf[0]):
            body += filler[prev:cut] + f
            prev = cut
        prompt = head + body + filler[prev:] + tail
        assert len(prompt) == length, (len(prompt), length)
        out.append(SyntheticExample(task, length, round(float(depth), 3), prompt, answer))
    return out


def solved(output: str, answer: str) -> bool:
    if answer.isdigit():
        return answer in re.findall(r"\d+", output)
    return " ".join(answer.lower().split()) in " ".join(output.lower().split())


def run_synthetic(
    engines: Engine | EngineFor,
    policies: Sequence[Policy],
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] = (256, 1024),
    n: int = 10,
    seed: int = 0,
    depths: Sequence[float] | None = None,
    prose_path: Path = EVAL_SAMPLE,
    spec: RunSpec | None = None,
) -> list[SyntheticResult]:
    """Accuracy per policy, task and prompt length; the same prompts for every policy, run on
    the serving engine (`spec`: memory budget and batching)."""
    for t in tasks:
        if t not in TASKS:
            raise PwctlError(f"unknown synthetic task '{t}'; tasks: {', '.join(TASKS)}")
    if n < 1:
        raise PwctlError("--examples must be at least 1")
    if depths and not all(0 <= d <= 1 for d in depths):
        raise PwctlError("--depths must lie in [0, 1] (a fraction of the filler)")
    pick = engine_for(engines)
    first = pick(policies[0])
    context = getattr(first.model.config, "max_position_embeddings", None) or 1 << 30
    for length in lengths:
        if length + max(MAX_NEW[t] for t in tasks) > context:
            raise PwctlError(f"--lengths {length}: the model's context is {context} tokens")
    prose = load_prose(first.tokenizer, prose_path)
    examples = [
        ex
        for t in tasks
        for length in lengths
        for ex in make_examples(first.tokenizer, prose, t, length, n, seed, depths)
    ]
    requests = [Request(ex.ids, MAX_NEW[ex.task]) for ex in examples]
    results = []
    for p in policies:
        texts, memory = run_policy(pick(p), p, requests, spec or RunSpec())
        hits: dict[str, dict[int, list[bool]]] = {t: {n_: [] for n_ in lengths} for t in tasks}
        records = []
        for ex, text in zip(examples, texts, strict=True):
            ok = solved(text, ex.answer)
            hits[ex.task][ex.length].append(ok)
            records.append(
                dict(task=ex.task, length=ex.length, depth=ex.depth, answer=ex.answer,
                     output=text, solved=ok)
            )  # fmt: skip
        acc = {t: {n_: sum(v) / len(v) for n_, v in by_len.items()} for t, by_len in hits.items()}
        results.append(SyntheticResult(str(p), acc, records, memory))
    return results


def memory_points(results: Sequence[SyntheticResult]) -> list[tuple[str, float, MemoryReport]]:
    """(policy, mean accuracy, the memory it was obtained at) of each run."""
    return [(r.policy, r.mean_accuracy, r.memory) for r in results if r.memory is not None]


def table(results: Sequence[SyntheticResult]) -> tuple[list[str], list[list]]:
    """A row per (task, length), a column per policy: the share of prompts solved."""
    columns = ["task", "tokens", *(r.policy for r in results)]
    first = results[0].accuracy
    rows = [[t, n, *(r.accuracy[t][n] for r in results)] for t in first for n in first[t]]
    return columns, rows
