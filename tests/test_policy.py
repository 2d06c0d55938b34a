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


def test_each_policy_is_parsed_into_its_kind_once():
    from pwctl.policy import Kind

    kinds = {
        "fp16": Kind.FP16, "uniform:4": Kind.FIXED, "static:0.3": Kind.STATIC,
        "dynamic-layer:0.3": Kind.PER_LAYER, "pagedweight:0.3": Kind.DYNAMIC,
        "pagedweight-router:0.3": Kind.DYNAMIC, "pagedweight-sensitivity:800MB": Kind.DYNAMIC,
    }  # fmt: skip
    assert {text: parse_policy(text).kind for text in kinds} == kinds
    assert parse_policy("pagedweight-paging:0.3").switched_off == "dynamic_paging"
    assert parse_policy("pagedweight:0.3").switched_off is None
