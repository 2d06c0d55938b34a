"""The continuous-batching scheduler: token budget, chunked prefill, queue bound, preemption by
recompute, make_room before preemption, aborts free blocks."""

import pytest

from pwctl.errors import PwctlError
from pwctl.runtime.engine.scheduler import QueueFull, SamplingParams, Scheduler, Sequence, Status
from pwctl.runtime.memory.kv_cache import KVCache, KVLayout

LAYOUT = KVLayout(n_layers=1, kv_heads=1, head_dim=2)


def make(capacity=16, block=4, **kw):
    kv = KVCache(LAYOUT, capacity, block)
    return kv, Scheduler(kv, **kw)


def run_step(s: Scheduler, token: int = 1):
    """What the engine does after the model ran: cache the tokens, sample for those at the end."""
    b = s.schedule()
    s.update(b)
    for seq, on in zip(b.seqs, b.sampling, strict=True):
        if on:
            seq.output_ids.append(token)
    return b


def test_token_budget_mixes_decode_and_chunked_prefill():
    kv, s = make(max_batch_tokens=6, max_seqs=4)
    a, b = Sequence([1] * 3), Sequence([2] * 10)
    s.add(a)
    s.add(b)
    first = run_step(s)
    assert first.n_tokens == [3, 3] and first.sampling == [True, False]  # b: a prefill chunk
    second = run_step(s)
    assert second.seqs == [a, b] and second.n_tokens == [1, 5]  # a decodes, b's next chunk
    assert second.total == 6
    third = run_step(s)
    assert third.n_tokens == [1, 2] and third.sampling == [True, True]
    assert b.num_computed == 10 and len(b.output_ids) == 1
    assert kv.used == kv.blocks_for(a.num_computed) + kv.blocks_for(b.num_computed)


def test_max_seqs_and_bounded_queue():
    _, s = make(max_batch_tokens=64, max_seqs=2, max_queue=2)
    seqs = [Sequence([i + 1] * 2) for i in range(2)]
    for q in seqs:
        s.add(q)
    with pytest.raises(QueueFull):
        s.add(Sequence([9]))
    run_step(s)
    assert len(s.running) == 2 and not s.waiting
    s.add(Sequence([3]))
    assert run_step(s).seqs == seqs  # the third waits for a free slot


def test_preemption_by_recompute_when_blocks_run_out():
    kv, s = make(capacity=3, block=4, max_batch_tokens=64, max_seqs=4)
    old, new = Sequence([1] * 4), Sequence([2] * 4)
    s.add(old)
    s.add(new)
    run_step(s)  # 2 blocks used, each sequence has 5 tokens: needs a second block
    b = run_step(s)
    assert b.preempted == [new] and b.seqs == [old]
    assert new.status is Status.WAITING and new.num_computed == 0 and new.preemptions == 1
    assert s.waiting[0] is new and kv.used == 2 and new.seq_id not in kv.tables
    s.finish(old, "length")
    b = run_step(s)  # recompute: the prompt plus the token it had generated
    assert b.seqs == [new] and b.n_tokens == [5] and b.sampling == [True]
    assert new.output_ids == [1, 1] and s.preemptions == 1


def test_make_room_is_asked_before_preempting():
    asked = []
    kv = KVCache(LAYOUT, 4, 4)
    kv.pool.set_limit(2)

    def make_room(n, urgent=False):
        asked.append(n)
        kv.pool.set_limit(kv.pool.limit + n)
        return True

    s = Scheduler(kv, max_batch_tokens=64, make_room=make_room)
    s.add(Sequence([1] * 4))
    s.add(Sequence([2] * 4))
    run_step(s)
    b = run_step(s)
    assert asked == [1, 1] and not b.preempted and kv.used == 4


def test_abort_and_finish_free_blocks():
    kv, s = make(max_batch_tokens=64)
    a, b = Sequence([1] * 9), Sequence([2] * 3)
    s.add(a)
    s.add(b)
    run_step(s)
    assert kv.used == 4
    assert s.abort(a.seq_id) is a and a.finish_reason == "abort" and kv.used == 1
    assert s.abort(a.seq_id) is None
    s.finish(b, "stop")
    assert kv.used == 0 and not s.has_work


def test_sampling_params_are_checked():
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"seed": 2**64}):
        with pytest.raises(PwctlError):
            SamplingParams(**bad)
    with pytest.raises(PwctlError, match="empty"):
        Sequence([])


def test_sampler_greedy_top_p_and_seed():
    import torch

    from pwctl.runtime.engine.sampler import sample

    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    greedy = Sequence([1], SamplingParams(temperature=0))
    narrow = Sequence([1], SamplingParams(temperature=1.0, top_p=0.01, seed=0))
    rows = logits.repeat(2, 1)
    assert all(sample(rows, [greedy, narrow]) == [1, 1] for _ in range(20))  # top token only
    draws = [
        sample(logits[None], [Sequence([1], SamplingParams(temperature=2.0, seed=s))])[0]
        for s in range(40)
    ]
    assert {1, 2} <= set(draws)  # really sampled
    again = [
        sample(logits[None], [Sequence([1], SamplingParams(temperature=2.0, seed=s))])[0]
        for s in range(40)
    ]
    assert draws == again  # a seed fixes the draw


def test_sampler_frequencies_follow_temperature_and_top_p():
    import torch

    from pwctl.runtime.engine.sampler import sample

    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    for temperature, top_p, want in (
        (1.0, 1.0, probs),
        (0.5, 1.0, probs**2 / (probs**2).sum()),  # logits / 0.5: probabilities squared
        (1.0, 0.7, torch.tensor([0.625, 0.375, 0, 0])),  # the nucleus: 0.5 + 0.3 reach 0.7
    ):
        seqs = [Sequence([1], SamplingParams(temperature=temperature, top_p=top_p))] * n
        got = torch.bincount(torch.tensor(sample(probs.log().repeat(n, 1), seqs)), minlength=4)
        assert torch.allclose(got / n, want, atol=0.015), (temperature, top_p, got / n)


def test_nucleus_equals_a_sort_of_every_row():
    # the nucleus found among the top NUCLEUS_K tokens, or past them by a full sort or a
    # bisected threshold, is the one a sort of the whole row gives, row by row
    import torch

    from pwctl.runtime.engine.sampler import NUCLEUS_K, nucleus

    gen = torch.Generator().manual_seed(0)
    for vocab, spread in ((4 * NUCLEUS_K, 4.0), (4 * NUCLEUS_K, 0.1), (50, 1.0)):
        probs = torch.softmax(torch.randn(6, vocab, generator=gen) * spread, -1)
        top_p = torch.tensor([0.1, 0.5, 0.9, 0.99, 1.0, 0.95])
        want = torch.zeros_like(probs, dtype=torch.bool)
        for i, row in enumerate(probs):
            sorted_p, order = row.sort(descending=True)
            keep = (sorted_p.cumsum(-1) - sorted_p < top_p[i]) | (top_p[i] >= 1)
            want[i, order[keep]] = True
        assert torch.equal(nucleus(probs, top_p, sync_free=False), want), (vocab, spread)
        # the device's way (no host sync): the same set where no probability ties the threshold
        assert torch.equal(nucleus(probs, top_p, sync_free=True), want), (vocab, spread)


def test_a_seeded_row_draws_the_same_in_any_batch():
    import torch

    from pwctl.runtime.engine.sampler import sample

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    alone, batched = Sequence([1], params), Sequence([1], params)
    others = [Sequence([1], SamplingParams(temperature=t)) for t in (0.0, 1.5, 0.7)]
    for _ in range(10):
        a = sample(logits[:1], [alone])[0]
        b = sample(logits, [batched, *others])[0]
        assert a == b


@pytest.mark.gpu
def test_sampler_on_cuda_follows_the_cpus():
    # the same draws on the device: frequencies, top-p, a seeded row alone and in a batch
    import torch

    from pwctl.runtime.engine.sampler import sample

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], device="cuda")
    n = 20000
    seqs = [Sequence([1], SamplingParams(temperature=1.0, top_p=0.7))] * n
    got = torch.bincount(torch.tensor(sample(probs.log().repeat(n, 1), seqs)), minlength=4)
    assert torch.allclose(got / n, torch.tensor([0.625, 0.375, 0, 0]), atol=0.015)
    logits = torch.randn(3, 152064, device="cuda") * 4
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3)
    alone, batched = Sequence([1], params), Sequence([1], params)
    greedy = Sequence([1], SamplingParams(temperature=0))
    for _ in range(5):
        a = sample(logits[:1], [alone])[0]
        b, g, _ = sample(logits, [batched, greedy, Sequence([1], SamplingParams(temperature=1))])
        assert a == b and g == int(logits[1].argmax())


def test_a_sequences_ids_between_two_positions_are_all_ids_sliced():
    seq = Sequence([5, 6, 7], output_ids=[8, 9])
    for start in range(6):
        for stop in range(start, 7):
            assert seq.ids(start, stop) == seq.all_ids[start:stop], (start, stop)
