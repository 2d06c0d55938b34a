"""Train and evaluate pwctl's two bundled tiny MoE models: tiny-mixtral and tiny-qwen-moe.

Each model trains on random 2048-token windows of ``TOKENS/train.bin.gz``; about 20% of the rows
are synthetic long-context retrieval examples (pass key, key-value lookup) built from real train
prose; for tiny-qwen-moe a curriculum (``--curriculum``, see ``Spec``) adds induction warm-up
copy rows and short-to-long retrieval examples in the first 40% of the budget. Training stops on
wall time (``--minutes``), then the model is evaluated (perplexity on
``eval.bin`` against a Kneser-Ney trigram baseline, retrieval accuracy by context length, router
load per expert) and saved as a plain Hugging Face folder (bf16 safetensors + tokenizer files +
``train_report.json``). Sized for one H200 within about five minutes per model; ``--smoke`` runs
a tiny version end to end on CPU.

    python recipes/train_moe.py --model all --tokens data/tokens --tokenizer data/tokenizer \\
        --corpus data/corpus --out out/models [--minutes 4] [--batch 32] [--smoke] \\
        [--curriculum auto|on|off]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2MoeConfig,
)

MODELS = ("tiny-mixtral", "tiny-qwen-moe")
AUX_COEF = 0.02  # router load-balancing loss weight (Switch-style, computed by transformers)
MAX_MODEL_BYTES = 11_000_000  # bf16 model.safetensors limit for the bundled models
ANSWER_ROOM = 8  # tokens greedily decoded for a retrieval answer (prompt = length - ANSWER_ROOM)
MIN_LR_RATIO = 0.1
LOG_EVERY = 25


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Spec:
    """Everything that differs between a full GPU run and a CPU smoke run."""

    seq_len: int = 2048
    batch: int = 32
    minutes: float = 4.0
    max_steps: int | None = None
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup_steps: int = 60
    # Retrieval rows and answer weight: on the H200, tiny-qwen-moe (2 layers) scored 0% on every
    # pass-key length after 1.5 min with 0.15 / 3.0 and 98-100% after 2 min with 0.2 / 10.
    retrieval_share: float = 0.2  # share of training rows that are retrieval examples
    answer_weight: float = 10.0  # loss weight of the answer tokens inside retrieval examples
    eval_tokens: int = 1_048_576
    eval_batch: int = 16
    ngram_tokens: int = 200_000_000
    retrieval_lengths: tuple[int, ...] = (256, 512, 1024, 2048)
    retrieval_examples: int = 50
    prose_chars: int = 12_000_000  # train prose tokenised for the training retrieval examples
    eval_prose_chars: int = 3_000_000
    experts_impl: str = "grouped_mm"
    compile: bool = False
    # Curriculum (off: the recipe that made the shipped tiny-mixtral, bit for bit). tiny-qwen-moe
    # never learned retrieval in two 3.4-min runs (pass key <= 0.30, key-value ~0, answer CE stuck
    # near 1.9 nats), yet one earlier trial did: the copy circuit a 2-layer model needs (layer-0
    # previous-token head + layer-1 induction head) forms abruptly and only sometimes on long,
    # sparse-answer rows. Three changes make it form early and reliably, all on the data side
    # (architecture, parameter count and optimiser untouched):
    # 1. induction warm-up: during the first ``copy_until`` of the budget ``copy_share`` of the rows
    #    are random token sequences shown twice, loss only on the second copy. Nothing but copying
    #    lowers that loss, so induction heads form within a few hundred steps (Olsson et al. 2022,
    #    "In-context learning and induction heads"; their 2-layer attention-only models form them
    #    on repeated text). Tokens are drawn from real prose so their embeddings are the real ones.
    # 2. short-to-long retrieval: examples start at ``ret_len_start`` tokens (many packed per row:
    #    ~10 answers per row instead of ~2-3, and the fact is near the query) and their upper bound
    #    grows geometrically to ``seq_len`` by ``ramp_until`` of the budget.
    # 3. more retrieval early: the share starts at ``ret_share_start`` and falls linearly to
    #    ``retrieval_share`` by ``ramp_until``, so the final 60% trains on the usual mix (ppl).
    # The learning rate is unchanged: tiny-mixtral learned the skill at 2e-3 and tiny-qwen-moe's
    # plain CE was on a par; its failure is the missing circuit, not the optimiser.
    curriculum: bool = False
    copy_share: float = 0.2  # share of rows that are copy rows while progress < copy_until
    copy_until: float = 0.25
    copy_len: tuple[int, int] = (16, 128)  # length range of one random sequence (shown twice)
    ret_share_start: float = 0.3
    ret_len_start: tuple[int, int] = (64, 256)  # example length range at the start
    ramp_until: float = 0.4


SMOKE = Spec(
    seq_len=256,
    batch=8,
    minutes=3.0,
    max_steps=20,
    warmup_steps=3,
    retrieval_share=0.25,
    eval_tokens=16 * 256,
    eval_batch=8,
    ngram_tokens=2_000_000,
    retrieval_lengths=(128, 256),
    retrieval_examples=8,
    prose_chars=400_000,
    eval_prose_chars=200_000,
    copy_len=(8, 32),
    ret_len_start=(64, 128),
)


def model_config(name: str, vocab_size: int, eos_id: int, smoke: bool) -> PretrainedConfig:
    """The fixed architecture of a bundled model (tiny dimensions when ``smoke``)."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        router_aux_loss_coef=AUX_COEF,
        output_router_logits=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )
    if name == "tiny-mixtral":
        dims: dict[str, Any] = dict(
            hidden_size=384,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=96,
        )
        if smoke:
            dims.update(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_local_experts=4,
                intermediate_size=32,
            )
        return MixtralConfig(**common, **dims)
    if name == "tiny-qwen-moe":
        dims = dict(
            hidden_size=384,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=192,
            intermediate_size=192,
            norm_topk_prob=False,
            decoder_sparse_step=1,
        )
        if smoke:
            dims.update(
                hidden_size=64,
                num_attention_heads=4,
                num_experts=8,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                intermediate_size=32,
            )
        return Qwen2MoeConfig(**common, **dims)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def num_experts(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_local_experts", None) or config.num_experts)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- token data


def read_tokens(path: Path) -> np.ndarray:
    """Raw little-endian uint16 token ids; ``.gz`` files are decompressed in memory."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return np.frombuffer(raw, dtype="<u2")


def eos_id_of(tokenizer: PreTrainedTokenizerBase) -> int:
    tok_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if isinstance(tok_id, int) and tok_id != tokenizer.unk_token_id:
        return tok_id
    return int(tokenizer.eos_token_id or 0)


def vocab_size_of(tokens_dir: Path, tokenizer: PreTrainedTokenizerBase) -> int:
    meta_path = tokens_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    vocab = int(meta.get("vocab_size", len(tokenizer)))
    if vocab < len(tokenizer):
        raise SystemExit(f"meta.json vocab_size {vocab} < tokenizer size {len(tokenizer)}")
    return vocab


# ----------------------------------------------------------------------------- retrieval data


@dataclass
class Prose:
    """Tokenised prose (documents joined by a blank line) with the places a sentence starts."""

    ids: np.ndarray
    starts: np.ndarray  # sorted positions i where ids[i] begins a new sentence
    words: np.ndarray  # lower-case words (str) used as keys in key-value examples


def sample_texts(
    corpus_dir: Path,
    split: str,
    max_chars: int,
    rng: np.random.Generator,
    fallback: np.ndarray,
    tokenizer: PreTrainedTokenizerBase,
) -> list[str]:
    """Random whole documents of ``corpus_dir/split.jsonl``, or decoded token slices without it."""
    path = corpus_dir / f"{split}.jsonl"
    if not path.exists():
        print(f"[prose] {path} missing: decoding prose from the {split} token file instead")
        span = min(len(fallback), max_chars // 3)
        start = int(rng.integers(0, len(fallback) - span + 1))
        text = tokenizer.decode(fallback[start : start + span].tolist())
        return [t for t in text.split(tokenizer.decode([eos_id_of(tokenizer)])) if t.strip()]
    lines = path.read_bytes().splitlines()
    texts: list[str] = []
    total = 0
    for i in rng.permutation(len(lines)):
        text = json.loads(lines[i])["text"].strip()
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def load_prose(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> Prose:
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids = np.fromiter((t for doc in encoded for t in [*doc, *sep]), dtype=np.int64)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    texts_of = [tokenizer.convert_tokens_to_string([p]) for p in pieces]
    ends = np.array([t.rstrip().endswith((".", "!", "?")) or t.endswith("\n\n") for t in texts_of])
    starts = np.flatnonzero(ends[ids[:-1]]) + 1
    counts = Counter(w for t in texts for w in re.findall(r"\b[a-z]{4,9}\b", t))
    words = [w for w, _ in counts.most_common(3000)] or ["alpha", "bravo", "delta", "gamma"]
    return Prose(ids=ids, starts=starts, words=np.array(words))


@dataclass
class Example:
    prompt: np.ndarray
    answer: str
    answer_ids: np.ndarray


class RetrievalBuilder:
    """Pass-key and key-value retrieval examples of an exact token length, built in token space."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prose: Prose, seed: int) -> None:
        self.tok = tokenizer
        self.prose = prose
        self.rng = np.random.default_rng(seed)
        self.eos = eos_id_of(tokenizer)
        self.fast = getattr(tokenizer, "backend_tokenizer", None)  # skips ~60% wrapper overhead

    def _enc(self, text: str) -> np.ndarray:
        if self.fast is not None:
            return np.asarray(self.fast.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        return np.asarray(self.tok.encode(text, add_special_tokens=False), dtype=np.int64)

    def _parts(self, kind: str, room: int) -> tuple[list[np.ndarray], np.ndarray, str]:
        """Facts to hide, the query, and the answer text; ``room`` bounds the facts' size."""
        if kind == "passkey":
            key = str(self.rng.integers(10000, 100000))
            fact = self._enc(f" The pass key is {key}. Remember it. {key} is the pass key.")
            return [fact], self._enc(" What is the pass key? The pass key is"), key
        n_pairs = int(self.rng.integers(2, max(3, min(8, room // 32) + 1)))
        keys = self.rng.choice(self.prose.words, size=n_pairs, replace=False)
        values = self.rng.integers(100, 100000, size=n_pairs)
        facts = [
            self._enc(f" The value for key {k} is {v}.") for k, v in zip(keys, values, strict=True)
        ]
        q = int(self.rng.integers(n_pairs))
        query = self._enc(f" What is the value for key {keys[q]}? The value for key {keys[q]} is")
        return facts, query, str(values[q])

    def _insert_points(self, start: int, size: int, count: int) -> list[int]:
        """Random depths in a filler span, each moved forward to the next sentence start."""
        lo, hi = np.searchsorted(self.prose.starts, [start, start + size])
        cands = self.prose.starts[lo:hi] - start
        depths = self.rng.integers(0, size + 1, size=count)
        if len(cands) == 0:
            return sorted(int(d) for d in depths)
        idx = np.minimum(np.searchsorted(cands, depths), len(cands) - 1)
        return sorted(int(c) for c in cands[idx])

    def example(self, kind: str, length: int, with_answer: bool = False) -> Example:
        """A prompt of ``length`` tokens, or of ``length`` minus the answer's tokens."""
        facts, query, answer = self._parts(kind, length)
        answer_ids = self._enc(f" {answer}")
        prompt_len = length - len(answer_ids) if with_answer else length
        size = prompt_len - len(query) - sum(len(f) for f in facts)
        if size < 0:
            raise ValueError(f"{kind} example does not fit in {prompt_len} tokens")
        start = int(self.rng.integers(0, len(self.prose.ids) - size))
        filler = self.prose.ids[start : start + size]
        parts, prev = [], 0
        for cut, fact in zip(self._insert_points(start, size, len(facts)), facts, strict=True):
            parts += [filler[prev:cut], fact]
            prev = cut
        parts += [filler[prev:], query]
        return Example(np.concatenate(parts), answer, answer_ids)

    def training_row(
        self,
        length: int,
        answer_weight: float,
        min_len: int = 128,
        max_len: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``length`` tokens of packed examples (each closed by EOS) and per-token loss weights.

        Examples are drawn ``min_len`` to ``max_len`` tokens long (a remainder shorter than
        ``min_len`` joins the last one, so one may reach ``max_len + min_len - 1``); the defaults
        (128, whole row) are the original recipe, RNG draw for draw.
        """
        ids: list[np.ndarray] = []
        weights: list[np.ndarray] = []
        left = length
        while left > 0:
            hi = left if max_len is None else min(left, max_len)
            n = left if left < 2 * min_len else int(self.rng.integers(min_len, hi + 1))
            n = left if left - n < min_len else n
            kind = "passkey" if self.rng.random() < 0.5 else "kv"
            ex = self.example(kind, n - 1, with_answer=True)
            w = np.ones(n, dtype=np.float32)
            w[len(ex.prompt) : len(ex.prompt) + len(ex.answer_ids)] = answer_weight
            ids.append(np.concatenate([ex.prompt, ex.answer_ids, [self.eos]]))
            weights.append(w)
            left -= n
        return np.concatenate(ids), np.concatenate(weights)

    def copy_row(self, length: int, min_len: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Induction warm-up row: ``EOS x_1..x_L x_1..x_L`` segments, cut to ``length`` tokens.

        ``x`` are tokens drawn at random positions of the prose (real token frequencies, no
        order, so the first copy is unpredictable and only copying predicts the second). Loss
        weights are 1 on the second copy except its first token, 0 elsewhere.
        """
        ids: list[np.ndarray] = []
        weights: list[np.ndarray] = []
        total = 0
        while total < length:
            n = int(self.rng.integers(min_len, max_len + 1))
            seq = self.prose.ids[self.rng.integers(0, len(self.prose.ids), size=n)]
            w = np.zeros(2 * n + 1, dtype=np.float32)
            w[n + 2 :] = 1.0
            ids.append(np.concatenate([[self.eos], seq, seq]))
            weights.append(w)
            total += 2 * n + 1
        return np.concatenate(ids)[:length], np.concatenate(weights)[:length]


# ----------------------------------------------------------------------------- training


class MasterAdamW:
    """AdamW on fp32 master copies of bf16 model weights.

    Why not autocast over fp32 weights: the fused experts (``grouped_mm``) are not autocast-aware
    and would run in fp32, autocast adds a cast kernel per weight per step (this model is small
    enough that launches matter), and bf16 weights mean the evaluated model is the saved model.
    The fp32 master copy keeps small AdamW updates from being rounded away in bf16.
    """

    def __init__(self, model: PreTrainedModel, spec: Spec, fused: bool) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        decay = [m for m in self.master if m.ndim >= 2]
        no_decay = [m for m in self.master if m.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
        for p in self.params:  # parameters only: buffers (RoPE inv_freq) must stay fp32
            p.data = p.data.to(torch.bfloat16)

    def step(self, lr: float) -> torch.Tensor:
        for m, p in zip(self.master, self.params, strict=True):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(self.master, self.params, strict=True):
                p.copy_(m)
        return norm


def lr_at(step: int, progress: float, spec: Spec) -> float:
    """Linear warm-up over steps, then cosine decay over the wall-time budget."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    cos = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return spec.lr * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * cos)


def switch_aux_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, used only if transformers returns none."""
    total = torch.zeros((), device=router_logits[0].device)
    for logits in router_logits:
        probs = logits.float().softmax(-1)
        n_exp = probs.shape[-1]
        chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, n_exp).sum(1).float()
        total = total + n_exp * (chosen.mean(0) * probs.mean(0)).sum()
    return total / len(router_logits)


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    wall_minutes: float
    tokens_per_s: float
    final_train_loss: float  # mean plain next-token CE over the last LOG_EVERY steps
    final_aux_loss: float
    final_answer_loss: float  # CE on retrieval answer tokens (weight > 1), same window
    loss_curve: list[tuple[int, float, float]]  # (step, plain CE, answer CE)
    peak_mem_gib: float


@dataclass(frozen=True)
class Mix:
    """One step's batch make-up: row counts and the retrieval example length range."""

    n_copy: int
    n_ret: int
    ret_len: tuple[int, int | None]  # (min, max) tokens per retrieval example; None: whole row


def batch_mix(spec: Spec, progress: float) -> Mix:
    """Rows per kind at ``progress`` (0..1 of the budget); fixed unless ``spec.curriculum``."""
    if not spec.curriculum:
        n_ret = min(spec.batch, round(spec.batch * spec.retrieval_share))
        return Mix(0, n_ret, (128, None))
    ramp = min(1.0, max(0.0, progress) / spec.ramp_until) if spec.ramp_until > 0 else 1.0
    share = spec.ret_share_start + (spec.retrieval_share - spec.ret_share_start) * ramp
    n_ret = min(spec.batch, round(spec.batch * share))
    n_copy = round(spec.batch * spec.copy_share) if progress < spec.copy_until else 0
    n_copy = min(n_copy, spec.batch - n_ret)
    lo0, hi0 = spec.ret_len_start
    hi = round(hi0 * (spec.seq_len / hi0) ** ramp)  # geometric: as many steps per doubling
    lo = min(128, max(lo0, hi // 4))
    return Mix(n_copy, n_ret, (lo, None if hi >= spec.seq_len else hi))


def make_batch(
    train: torch.Tensor,
    builder: RetrievalBuilder,
    spec: Spec,
    gen: torch.Generator,
    mix: Mix | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows [B, T+1] (random windows, copy rows, retrieval rows) and target weights [B, T].

    Rows come in that order: plain windows, then ``mix.n_copy`` copy rows, then retrieval rows.
    """
    device = train.device
    mix = mix or batch_mix(spec, 0.0)
    n_ret = mix.n_ret
    n_plain = spec.batch - n_ret - mix.n_copy
    starts = torch.randint(
        0, len(train) - spec.seq_len - 1, (n_plain,), device=device, generator=gen
    )
    rows = train[starts[:, None] + torch.arange(spec.seq_len + 1, device=device)].long()
    weights = torch.ones(n_plain, spec.seq_len, device=device)
    lo, hi = mix.ret_len
    built = [builder.copy_row(spec.seq_len + 1, *spec.copy_len) for _ in range(mix.n_copy)]
    built += [
        builder.training_row(spec.seq_len + 1, spec.answer_weight, lo, hi) for _ in range(n_ret)
    ]
    if built:
        ids = torch.from_numpy(np.stack([b[0] for b in built]))
        wts = torch.from_numpy(np.stack([b[1][1:] for b in built]))
        if device.type == "cuda":
            ids, wts = ids.pin_memory(), wts.pin_memory()
        rows = torch.cat([rows, ids.to(device, non_blocking=True)])
        weights = torch.cat([weights, wts.to(device, non_blocking=True)])
    return rows, weights


def train(
    model: PreTrainedModel,
    train_ids: torch.Tensor,
    builder: RetrievalBuilder,
    spec: Spec,
    seed: int,
) -> TrainResult:
    device = train_ids.device
    opt = MasterAdamW(model, spec, fused=device.type == "cuda")
    step_fn = torch.compile(model) if spec.compile else model
    gen = torch.Generator(device=device).manual_seed(seed)
    top_k = int(model.config.num_experts_per_tok)
    budget_s = spec.minutes * 60.0
    sums = torch.zeros(3, device=device)  # plain CE, aux loss, answer CE since the last log
    copy_sum = torch.zeros(2, device=device)  # copy-row CE sum and steps with copy rows
    curve: list[tuple[int, float, float]] = []
    last = [float("nan")] * 3
    step = tokens = 0
    model.train()
    t0 = time.perf_counter()

    def log(n: int, lr: float) -> None:
        last[:] = (sums / n).tolist()
        sums.zero_()
        curve.append((step, round(last[0], 4), round(last[2], 4)))
        el = time.perf_counter() - t0
        extra = ""
        if spec.curriculum:
            c_sum, c_n = copy_sum.tolist()
            copy_sum.zero_()
            extra = f"  copy ce {c_sum / c_n:.3f}" if c_n else ""
            extra += f"  rows p/c/r {spec.batch - mix.n_copy - mix.n_ret}/{mix.n_copy}/{mix.n_ret}"
            extra += f" ret len {mix.ret_len[1] or spec.seq_len}"
        print(
            f"  step {step:5d}  ce {last[0]:.4f}  aux {last[1]:.4f}  answer ce {last[2]:.3f}  "
            f"lr {lr:.2e}  {tokens / el:,.0f} tok/s  {el:.0f}s{extra}",
            flush=True,
        )

    lr = spec.lr
    mix = batch_mix(spec, 0.0)
    while True:
        progress = (time.perf_counter() - t0) / budget_s
        if spec.max_steps is not None:
            progress = max(progress, step / spec.max_steps)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, spec)
        mix = batch_mix(spec, progress)
        rows, weights = make_batch(train_ids, builder, spec, gen, mix)
        out = step_fn(input_ids=rows[:, :-1], output_router_logits=True)
        ce_tok = F.cross_entropy(
            out.logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="none"
        )
        ce = (ce_tok * weights.flatten()).sum() / weights.sum()
        n_plain = spec.batch - mix.n_copy - mix.n_ret
        if mix.n_copy:  # copy rows: logged apart, kept out of the plain CE (random first copy)
            ce_rows = ce_tok.detach().view(spec.batch, -1)
            c_w = weights[n_plain : n_plain + mix.n_copy]
            c_ce = (ce_rows[n_plain : n_plain + mix.n_copy] * c_w).sum() / c_w.sum()
            copy_sum += torch.stack([c_ce, torch.ones_like(c_ce)])
            keep = torch.cat([ce_rows[:n_plain], ce_rows[n_plain + mix.n_copy :]])
            plain_ce = keep.mean()
        else:
            plain_ce = ce_tok.detach().mean()
        aux = (
            out.aux_loss if out.aux_loss is not None else switch_aux_loss(out.router_logits, top_k)
        )
        (ce + AUX_COEF * aux).backward()
        opt.step(lr)
        answer = (weights > 1).flatten()
        answer_ce = (ce_tok.detach() * answer).sum() / answer.sum().clamp(min=1)
        sums += torch.stack([plain_ce, aux.detach().float(), answer_ce])
        step += 1
        tokens += rows.shape[0] * spec.seq_len
        if step % LOG_EVERY == 0:
            log(LOG_EVERY, lr)
    if step % LOG_EVERY:
        log(step % LOG_EVERY, lr)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    model.eval()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return TrainResult(
        step, tokens, wall / 60, tokens / wall, last[0], last[1], last[2], curve, peak
    )


# ----------------------------------------------------------------------------- evaluation


def eval_windows(tokens: np.ndarray, spec: Spec) -> torch.Tensor:
    n_win = min(len(tokens) - 1, spec.eval_tokens) // spec.seq_len
    if n_win == 0:
        raise SystemExit(f"eval split has fewer than {spec.seq_len} tokens")
    return torch.from_numpy(tokens[: n_win * spec.seq_len].astype(np.int64)).view(n_win, -1)


@torch.no_grad()
def perplexity_and_routing(
    model: PreTrainedModel, windows: torch.Tensor, spec: Spec
) -> dict[str, Any]:
    """Perplexity on non-overlapping windows and the share of routed tokens per expert."""
    device = next(model.parameters()).device
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, num_experts(cfg), device=device)
    nll = torch.zeros((), dtype=torch.float64, device=device)
    for chunk in windows.split(spec.eval_batch):
        x = chunk.to(device)
        out = model(input_ids=x, output_router_logits=True)
        nll += F.cross_entropy(
            out.logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum"
        ).double()
        for layer, logits in enumerate(out.router_logits):
            top = logits.topk(cfg.num_experts_per_tok, dim=-1).indices.flatten()
            counts[layer] += torch.bincount(top, minlength=counts.shape[1])
    n_pred = windows.shape[0] * (windows.shape[1] - 1)
    share = (counts / counts.sum(1, keepdim=True)).cpu()
    ratio = [round(float(s.max() / s.min()), 3) if s.min() > 0 else None for s in share]
    return {
        "eval_tokens": n_pred,
        "perplexity": round(math.exp(nll.item() / n_pred), 4),
        "router": {
            "share_per_layer": [[round(float(v), 5) for v in s] for s in share],
            "max_min_ratio": ratio,
            "dead_experts": [int((s == 0).sum()) for s in share],
        },
    }


def _lookup(keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """values[i] where keys[i] == query (keys sorted and unique), else 0."""
    pos = torch.searchsorted(keys, query).clamp(max=len(keys) - 1)
    return torch.where(keys[pos] == query, values[pos], torch.zeros_like(values[pos]))


def _discount(counts: torch.Tensor) -> float:
    n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
    return n1 / (n1 + 2 * n2) if n1 + n2 > 0 else 0.75


class KneserNeyTrigram:
    """Interpolated Kneser-Ney trigram model (one absolute discount per order, Chen & Goodman).

    The unigram level is the continuation distribution interpolated with a uniform one, so every
    token has a finite probability. Built with vectorised torch ops on the run's device.
    """

    def __init__(self, tokens: torch.Tensor, vocab: int) -> None:
        v = self.v = vocab
        t = tokens.long()
        self.tri, c3 = torch.unique((t[:-2] * v + t[1:-1]) * v + t[2:], return_counts=True)
        self.c3 = c3.double()
        self.ab, inv_ab, n_ab = torch.unique_consecutive(
            self.tri // v, return_inverse=True, return_counts=True
        )
        self.n_ab = n_ab.double()  # distinct c after (a, b)
        self.c_ab = torch.zeros(len(self.ab), dtype=torch.float64, device=t.device).index_add_(
            0, inv_ab, self.c3
        )
        self.bc, n_bc = torch.unique(self.tri % (v * v), return_counts=True)
        self.n_bc = n_bc.double()  # distinct a before (b, c)
        b_of_bc = self.bc // v
        self.n_b_mid = torch.bincount(b_of_bc, weights=self.n_bc, minlength=v)
        self.n_b_follow = torch.bincount(b_of_bc, minlength=v).double()
        self.n_c = torch.bincount(self.bc % v, minlength=v).double()  # distinct b before c
        self.d3, self.d2, self.d1 = _discount(c3), _discount(n_bc), _discount(self.n_c)

    def prob(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        v = self.v
        total, seen = self.n_c.sum(), (self.n_c > 0).sum()
        p1 = ((self.n_c[c] - self.d1).clamp(min=0) + self.d1 * seen / v) / total
        mid = self.n_b_mid[b]
        p2_num = (_lookup(self.bc, self.n_bc, b * v + c) - self.d2).clamp(min=0)
        p2 = torch.where(
            mid > 0, (p2_num + self.d2 * self.n_b_follow[b] * p1) / mid.clamp(min=1), p1
        )
        ctx = _lookup(self.ab, self.c_ab, a * v + b)
        p3_num = (_lookup(self.tri, self.c3, (a * v + b) * v + c) - self.d3).clamp(min=0)
        back = self.d3 * _lookup(self.ab, self.n_ab, a * v + b)
        return torch.where(ctx > 0, (p3_num + back * p2) / ctx.clamp(min=1), p2)


def ngram_perplexity(
    train_ids: torch.Tensor, windows: torch.Tensor, vocab: int, spec: Spec
) -> dict[str, Any]:
    """KN trigram fit on train tokens, scored on the same targets as the model."""
    lm = KneserNeyTrigram(train_ids[: spec.ngram_tokens], vocab)
    device = train_ids.device
    stream = windows.flatten().to(device)
    pos = (
        torch.arange(windows.shape[0], device=device)[:, None] * windows.shape[1]
        + torch.arange(1, windows.shape[1], device=device)
    ).flatten()
    prev2 = torch.where(pos >= 2, stream[(pos - 2).clamp(min=0)], stream.new_tensor(0))
    p = lm.prob(prev2, stream[pos - 1], stream[pos])
    return {
        "perplexity": round(math.exp(-p.log().mean().item()), 4),
        "train_tokens": int(min(len(train_ids), spec.ngram_tokens)),
        "discounts": [round(d, 4) for d in (lm.d1, lm.d2, lm.d3)],
        "trigram_types": len(lm.tri),
    }


@torch.no_grad()
def greedy(model: PreTrainedModel, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts (no cache: a few full passes are cheap)."""
    seq = prompts
    for _ in range(n_new):
        logits = model(input_ids=seq, logits_to_keep=1, output_router_logits=False).logits
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompts.shape[1] :]


def retrieval_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    builder_seed: int,
    prose: Prose,
    spec: Spec,
) -> dict[str, dict[str, float]]:
    """Exact-match accuracy of the greedily decoded number, by kind and context length."""
    device = next(model.parameters()).device
    result: dict[str, dict[str, float]] = {}
    for kind in ("passkey", "kv"):
        builder = RetrievalBuilder(tokenizer, prose, builder_seed)  # same examples every model
        result[kind] = {}
        for length in spec.retrieval_lengths:
            exs = [
                builder.example(kind, length - ANSWER_ROOM) for _ in range(spec.retrieval_examples)
            ]
            prompts = torch.from_numpy(np.stack([e.prompt for e in exs])).to(device)
            outs = [greedy(model, chunk, ANSWER_ROOM) for chunk in prompts.split(spec.eval_batch)]
            texts = tokenizer.batch_decode(torch.cat(outs).tolist())
            hits = [
                (m := re.match(r"\s*(\d+)", t)) is not None and m.group(1) == e.answer
                for t, e in zip(texts, exs, strict=True)
            ]
            result[kind][str(length)] = round(sum(hits) / len(hits), 4)
    return result


# ----------------------------------------------------------------------------- saving


def param_counts(model: PreTrainedModel) -> dict[str, int]:
    cfg = model.config
    total = expert = shared = 0
    for name, p in model.named_parameters():
        total += p.numel()
        expert += p.numel() if ".experts." in name else 0
        shared += p.numel() if ".shared_expert" in name else 0
    active = total - expert + expert * cfg.num_experts_per_tok // num_experts(cfg)
    return {
        "total": total,
        "expert": expert,
        "non_expert": total - expert,
        "shared_expert": shared,
        "active_per_token": active,
    }


def write_json(path: Path, data: Any) -> None:
    """Atomic JSON write: a temporary file in the same folder, then os.replace."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


@torch.no_grad()
def verify_saved(
    folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sample: torch.Tensor
) -> dict[str, Any]:
    """Reload the folder with plain transformers, compare logits, and generate a little."""
    device = sample.device
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    diff = loaded(input_ids=sample).logits.float() - model(input_ids=sample).logits.float()
    prompt = tokenizer("The pass key is", return_tensors="pt").input_ids.to(device)
    gen = loaded.generate(
        prompt, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt)
    )
    return {
        "reload_max_abs_logit_diff": float(diff.abs().max()),
        "sample_generation": tokenizer.decode(gen[0]),
    }


def save_model(
    model: PreTrainedModel,
    tokenizer_dir: Path,
    out_dir: Path,
    name: str,
    report: dict[str, Any],
    verify: Callable[[Path], dict[str, Any]],
) -> Path:
    """Write NAME/ to a temporary folder, check it, then swap it in with os.replace."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out_dir))
    model.config.output_router_logits = False  # serving needs no router logits
    model.save_pretrained(tmp)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    report["file_bytes"] = (tmp / "model.safetensors").stat().st_size
    report["saved_check"] = verify(tmp)
    write_json(tmp / "train_report.json", report)
    for f in tmp.iterdir():
        f.chmod(0o644)
    tmp.chmod(0o755)
    final = out_dir / name
    if final.exists():
        old = out_dir / f".{name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    return final


# ----------------------------------------------------------------------------- main


@dataclass
class Data:
    tokenizer: PreTrainedTokenizerBase
    vocab: int
    train_ids: torch.Tensor  # on the run's device, int32
    eval_windows: torch.Tensor
    train_prose: Prose
    eval_prose: Prose


def load_data(args: argparse.Namespace, spec: Spec, device: torch.device) -> Data:
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = vocab_size_of(args.tokens, tokenizer)
    train_np = read_tokens(args.tokens / "train.bin.gz")
    if int(train_np.max()) >= vocab:
        raise SystemExit(f"train tokens exceed vocab size {vocab}")
    calib_np = read_tokens(args.tokens / "calib.bin")
    rng = np.random.default_rng(args.seed)
    train_texts = sample_texts(args.corpus, "train", spec.prose_chars, rng, train_np, tokenizer)
    eval_texts = sample_texts(args.corpus, "calib", spec.eval_prose_chars, rng, calib_np, tokenizer)
    return Data(
        tokenizer=tokenizer,
        vocab=vocab,
        train_ids=torch.from_numpy(train_np.astype(np.int32)).to(device),
        eval_windows=eval_windows(read_tokens(args.tokens / "eval.bin"), spec),
        train_prose=load_prose(train_texts, tokenizer),
        eval_prose=load_prose(eval_texts, tokenizer),
    )


def build_model(
    name: str, data: Data, spec: Spec, smoke: bool, device: torch.device
) -> PreTrainedModel:
    config = model_config(name, data.vocab, eos_id_of(data.tokenizer), smoke)
    model = AutoModelForCausalLM.from_config(
        config, experts_implementation=spec.experts_impl, attn_implementation="sdpa"
    )
    n_bytes = 2 * sum(p.numel() for p in model.parameters())
    if not smoke and n_bytes > MAX_MODEL_BYTES:
        raise SystemExit(f"{name}: {n_bytes:,} bf16 bytes > {MAX_MODEL_BYTES:,}; shrink experts")
    return model.to(device)


def run_one(
    name: str, data: Data, spec: Spec, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    t_start = time.perf_counter()
    seed = args.seed + MODELS.index(name)
    seed_everything(seed)
    model = build_model(name, data, spec, args.smoke, device)
    params = param_counts(model)
    print(
        f"[{name}] params {params}  experts={spec.experts_impl}  batch={spec.batch}x"
        f"{spec.seq_len}  budget {spec.minutes} min  curriculum {spec.curriculum}",
        flush=True,
    )
    builder = RetrievalBuilder(data.tokenizer, data.train_prose, seed + 100)
    tr = train(model, data.train_ids, builder, spec, seed)
    timings = {"train_s": round(tr.wall_minutes * 60, 1)}
    t = time.perf_counter()
    ev = perplexity_and_routing(model, data.eval_windows, spec)
    timings["ppl_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    ev["retrieval"] = retrieval_accuracy(
        model, data.tokenizer, args.seed + 7, data.eval_prose, spec
    )
    timings["retrieval_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    ev["ngram_baseline"] = ngram_perplexity(data.train_ids, data.eval_windows, data.vocab, spec)
    timings["ngram_s"] = round(time.perf_counter() - t, 1)
    report: dict[str, Any] = {
        "model": name,
        "smoke": args.smoke,
        "device": str(device),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "spec": asdict(spec),
        "params": params,
        "train": asdict(tr),
        "eval": ev,
        "timings": timings,
    }
    sample = data.eval_windows[:1, :256].to(device)
    t = time.perf_counter()
    folder = save_model(
        model,
        args.tokenizer,
        args.out,
        name,
        report,
        lambda path: verify_saved(path, model, data.tokenizer, sample),
    )
    timings["save_s"] = round(time.perf_counter() - t, 1)
    timings["total_s"] = round(time.perf_counter() - t_start, 1)
    write_json(folder / "train_report.json", report)
    return report


def summary(report: dict[str, Any]) -> str:
    tr, ev = report["train"], report["eval"]
    p, r = report["params"], ev["retrieval"]
    return "\n".join(
        [
            f"== {report['model']}: {p['total']:,} params ({p['expert']:,} expert, "
            f"{p['non_expert']:,} non-expert), model.safetensors {report['file_bytes']:,} bytes",
            f"   train {tr['wall_minutes']:.2f} min, {tr['steps']} steps, {tr['tokens_seen']:,} "
            f"tokens ({tr['tokens_per_s']:,.0f}/s), final loss {tr['final_train_loss']:.4f}, "
            f"peak {tr['peak_mem_gib']:.1f} GiB",
            f"   eval ppl {ev['perplexity']:.2f} vs KN-trigram "
            f"{ev['ngram_baseline']['perplexity']:.2f} on {ev['eval_tokens']:,} tokens",
            f"   passkey {r['passkey']}  kv {r['kv']}",
            f"   router max/min share per layer {ev['router']['max_min_ratio']}",
            f"   reload diff {report['saved_check']['reload_max_abs_logit_diff']:.3g}, sample: "
            f"{report['saved_check']['sample_generation'][:80]!r}",
            f"   timings {report['timings']}",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--tokens", type=Path, default=Path("data/tokens"))
    p.add_argument("--tokenizer", type=Path, default=Path("data/tokenizer"))
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, help="training wall-time budget per model")
    p.add_argument("--batch", type=int, help="rows of seq_len tokens per step")
    p.add_argument("--max-steps", type=int, help="stop after this many steps as well")
    p.add_argument("--lr", type=float)
    p.add_argument("--retrieval-share", type=float, help="share of rows that are retrieval")
    p.add_argument("--answer-weight", type=float, help="loss weight of retrieval answers")
    p.add_argument(
        "--curriculum",
        choices=["auto", "on", "off"],
        default="auto",
        help="induction warm-up + short-to-long retrieval (see Spec); auto: on for tiny-qwen-moe",
    )
    p.add_argument("--copy-share", type=float, help="share of copy rows during the warm-up")
    p.add_argument("--copy-until", type=float, help="copy rows until this fraction of the budget")
    p.add_argument("--ret-share-start", type=float, help="retrieval share at the start")
    p.add_argument("--ramp-until", type=float, help="fraction of the budget to reach full mix")
    p.add_argument("--experts-impl", choices=["grouped_mm", "batched_mm", "eager"])
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slow start)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny dims, ~20 steps, small eval")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_spec(args: argparse.Namespace) -> Spec:
    spec = SMOKE if args.smoke else Spec()
    overrides = {
        "minutes": args.minutes,
        "batch": args.batch,
        "max_steps": args.max_steps,
        "lr": args.lr,
        "experts_impl": args.experts_impl,
        "retrieval_share": args.retrieval_share,
        "answer_weight": args.answer_weight,
        "copy_share": args.copy_share,
        "copy_until": args.copy_until,
        "ret_share_start": args.ret_share_start,
        "ramp_until": args.ramp_until,
    }
    spec = replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    return replace(spec, compile=args.compile) if args.compile else spec


def model_spec(spec: Spec, name: str, curriculum: str) -> Spec:
    """The run's Spec for one model: ``--curriculum auto`` turns it on for tiny-qwen-moe only."""
    on = curriculum == "on" or (curriculum == "auto" and name == "tiny-qwen-moe")
    return replace(spec, curriculum=on)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spec = make_spec(args)
    device = torch.device(args.device)
    t = time.perf_counter()
    data = load_data(args, spec, device)
    print(
        f"data: {len(data.train_ids):,} train tokens, {data.eval_windows.numel():,} eval tokens,"
        f" prose {len(data.train_prose.ids):,}/{len(data.eval_prose.ids):,} tokens, "
        f"loaded in {time.perf_counter() - t:.1f}s",
        flush=True,
    )
    for name in MODELS if args.model == "all" else (args.model,):
        one = model_spec(spec, name, args.curriculum)
        print(summary(run_one(name, data, one, args, device)), flush=True)


if __name__ == "__main__":
    main()
