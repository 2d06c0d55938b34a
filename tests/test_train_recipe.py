"""recipes/train_moe.py's data side: packed retrieval rows, induction warm-up rows, the curriculum
schedule (fast, CPU; uses the bundled tokenizer and eval sample, not data/)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from pwctl.build.checkpoint import EVAL_SAMPLE, MODELS_DIR

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train_moe.py"


@pytest.fixture(scope="module")
def tm():
    spec = importlib.util.spec_from_file_location("train_moe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_moe"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(tm):
    tok = AutoTokenizer.from_pretrained(MODELS_DIR / "tiny-qwen-moe")
    text = EVAL_SAMPLE.read_text()[:60_000]
    prose = tm.load_prose([t for t in text.split("\n\n") if t.strip()], tok)
    return tok, prose


def _examples(ids: np.ndarray, eos: int) -> list[tuple[int, int]]:
    """(start, end) of each EOS-closed example in a packed row (end = index of its EOS)."""
    ends = np.flatnonzero(ids == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


@pytest.mark.parametrize("lo_hi", [(64, 256), (128, 512), (128, None)])
def test_retrieval_row_lengths_and_answer_mask(tm, setup, lo_hi):
    tok, prose = setup
    lo, hi = lo_hi
    builder = tm.RetrievalBuilder(tok, prose, seed=3)
    for _ in range(2):
        ids, w = builder.training_row(2049, 10.0, lo, hi)
        assert ids.shape == w.shape == (2049,)
        assert ids[-1] == builder.eos
        exs = _examples(ids, builder.eos)
        assert len(exs) >= (2 if hi is None else 2049 // (hi + lo))
        assert (w == 10.0).sum() >= len(exs)  # every example has answer tokens
        assert set(np.unique(w).tolist()) <= {1.0, 10.0}
        for start, end in exs:
            n = end - start + 1
            assert n >= lo
            if hi is not None:
                assert n < hi + lo
            ans = np.flatnonzero(w[start : end + 1] == 10.0) + start
            assert ans.size and ans[-1] == end - 1  # answer runs up to the closing EOS
            assert np.array_equal(ans, np.arange(ans[0], end))
            prompt = tok.decode(ids[start : ans[0]].tolist())
            assert prompt.endswith(("The pass key is", "is"))
            assert re.fullmatch(r" \d+", tok.decode(ids[ans].tolist()))


def test_default_row_is_the_original_recipe(tm, setup):
    tok, prose = setup
    a = tm.RetrievalBuilder(tok, prose, seed=5).training_row(2049, 10.0)
    b = tm.RetrievalBuilder(tok, prose, seed=5).training_row(2049, 10.0, 128, None)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    spec = tm.Spec()
    assert not spec.curriculum
    for progress in (0.0, 0.1, 0.5, 0.99):
        assert tm.batch_mix(spec, progress) == tm.Mix(0, round(32 * 0.2), (128, None))


def test_copy_row(tm, setup):
    tok, prose = setup
    builder = tm.RetrievalBuilder(tok, prose, seed=7)
    ids, w = builder.copy_row(2049, 16, 128)
    assert ids.shape == w.shape == (2049,)
    exs = _examples(np.append(ids, builder.eos), builder.eos)[1:]  # row starts with EOS
    for start, end in exs[:-1]:  # whole segments (the last may be cut)
        n = (end - start) // 2
        assert 16 <= n <= 128 and end - start == 2 * n
        assert np.array_equal(ids[start : start + n], ids[start + n : end])
        assert not w[start - 1 : start + n + 1].any()  # EOS, first copy, 1st token of 2nd copy
        assert (w[start + n + 1 : end] == 1).all()


def test_curriculum_schedule(tm):
    spec = tm.Spec(curriculum=True)
    first, mid, late = (tm.batch_mix(spec, p) for p in (0.0, 0.2, 0.5))
    assert first == tm.Mix(round(32 * 0.2), round(32 * 0.3), (64, 256))
    assert mid.n_copy == first.n_copy and 256 < mid.ret_len[1] < 2048
    assert late == tm.Mix(0, round(32 * 0.2), (128, None))  # the default mix after the ramp
    smoke = tm.model_spec(tm.SMOKE, "tiny-mixtral", "auto")
    assert not smoke.curriculum and tm.model_spec(tm.SMOKE, "tiny-qwen-moe", "auto").curriculum
