import pytest

from pwctl.errors import PwctlError
from pwctl.policy import parse_budget, parse_policy


def test_budgets():
    assert parse_budget("0.35").resolve(1000) == 350
    assert parse_budget("800MB").resolve(0) == 800_000_000
    assert parse_budget("12GiB").nbytes == 12 * 2**30
    for bad in ("0", "1.5", "12XB", "lots"):
        with pytest.raises(PwctlError):
            parse_budget(bad)


def test_policies():
    assert str(parse_policy("uniform:3")) == "uniform:3"
    assert parse_policy("pagedweight-router:0.3").budget.fraction == 0.3
    assert parse_policy("fp16").bits is None
    for bad in ("uniform", "uniform:9", "pagedweight", "lru:0.3", "fp16:3"):
        with pytest.raises(PwctlError):
            parse_policy(bad)
