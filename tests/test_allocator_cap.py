"""The allocator cap (accounting.cap_allocator): temporaries of growing size, each followed by a
small tensor that stays, leave free pages behind that the next, larger temporary cannot use.
Uncapped, the reserved mark climbs far past what is live; capped, the allocator gives those
pages back and the same run stays under the cap."""

import pytest
import torch

from pwctl.runtime.memory.accounting import cap_allocator, configure_allocator

MIB = 1 << 20


def growing_temporaries(device: str) -> int:
    """Reserved bytes the run added at its high-water mark; what it kept is freed after."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_reserved(device)
    kept = []
    for i in range(16):
        temp = torch.ones((i + 1) * 8 * MIB, dtype=torch.uint8, device=device)
        kept.append(torch.ones(2 * MIB, dtype=torch.uint8, device=device))
        del temp
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_reserved(device) - base
    del kept
    torch.cuda.empty_cache()
    return grown


@pytest.mark.gpu
def test_the_cap_gives_free_pages_back_before_the_budget_passes():
    configure_allocator()
    device = "cuda"
    live = 16 * 8 * MIB + 16 * 2 * MIB  # the largest temporary and what stays
    uncapped = growing_temporaries(device)
    assert uncapped > 2 * live  # the pattern does leave unusable free pages behind
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(device)
    try:
        cap = cap_allocator(device, base + live + 64 * MIB)
        capped = growing_temporaries(device)
        assert base + capped <= cap, (capped / MIB, cap / MIB)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
