"""WidthPlan is the one writer of the planned widths: every reader gets a read-only view that
follows its `set`, and a write through any other path fails."""

import numpy as np
import pytest

from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.widths.width_plan import WidthPlan


def test_the_view_follows_set_and_refuses_writes():
    plan = WidthPlan(5, 8)
    view = plan.widths
    plan.set(np.array([2, 3, 4, 5, 6]))
    assert view.tolist() == [2, 3, 4, 5, 6]
    plan.set(7, 1)
    assert view.tolist() == [2, 7, 4, 5, 6]
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 3
    with pytest.raises(ValueError, match="read-only"):
        np.minimum(view, 4, out=view)


def test_the_engine_and_memory_budget_write_only_through_the_plan(bundled_pack):
    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_seqs=2, max_batch_tokens=16, max_model_len=64)
    batcher = engine.start_batching(parse_policy("pagedweight:0.3"), None, cfg)
    assert batcher.memory.widths is not None
    with pytest.raises(ValueError, match="read-only"):
        engine.store.widths[:] = 3
    with pytest.raises(ValueError, match="read-only"):
        batcher.memory.widths[0] = 3
    engine.set_policy(parse_policy("uniform:4"))
    assert (engine.store.widths == 4).all() and (batcher.memory.widths == 4).all()
