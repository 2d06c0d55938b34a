"""The fused MoE path: grouping, the plane-order layout and the torch path (CPU) against the
ExpertStore reference; the CUDA kernels against the torch path on real layer shapes (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pwctl.bench.kernels import SHAPES, random_routing, synthetic_layer
from pwctl.pack import Pack
from pwctl.recipe import MoESpec
from pwctl.runtime.device_table import DeviceTable
from pwctl.runtime.expert_store import ExpertStore
from pwctl.runtime.fused_moe import FusedMoE, fragment_order, group
from pwctl.runtime.moe import route
from pwctl.runtime.page_table import PageTable
from pwctl.runtime.pager import CpuBackend, Pager


def test_group_sorts_pairs_by_expert():
    gen = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    pairs = group(index, weights, 6)
    seen = set()
    for s in range(pairs.expert.numel()):
        lo, hi, e = int(pairs.lo[s]), int(pairs.hi[s]), int(pairs.expert[s])
        for i in range(lo, hi):
            t = int(pairs.token[i])
            slot = (index[t] == e).nonzero().item()
            assert float(pairs.weight[i]) == float(weights[t, slot])
            seen.add((t, e))
    assert seen == {(t, int(e)) for t in range(5) for e in index[t]}
    assert int((pairs.hi > pairs.lo).sum()) == len(set(index.flatten().tolist()))


def test_fragment_order_layout():
    x = torch.randn(3, 70)
    xf = fragment_order(x, 8)
    assert xf.shape == (3, 8, 32) and xf.dtype == torch.float16
    for w in range(8):  # word w, k-step s, element i: column 32w + s // 2 + 16 (s % 2) + 4i
        for s in range(8):
            for i in range(4):
                c = 32 * w + s // 2 + 16 * (s % 2) + 4 * i
                expect = x[:, c].half() if c < 70 else torch.zeros(3, dtype=torch.float16)
                assert torch.equal(xf[:, w, 4 * s + i], expect)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_torch_path_matches_expert_store(packs, arch):
    """Planes paged by the pager (mixed widths) and read back through the DeviceTable give the
    same layer output as the ExpertStore reference at the same widths."""
    pack = Pack(packs[(arch, "per_expert")])
    m = pack.manifest
    spec = MoESpec(**m.spec)
    full = sum(b.bytes_at(m.max_bits) for b in pack.blocks)
    table = PageTable.from_pack(pack, budget_bytes=2 * full)
    backend = CpuBackend.from_pack(pack, table)
    pager = Pager(table, backend)
    rng = np.random.default_rng(0)
    pager.request(rng.integers(m.min_bits, m.max_bits + 1, table.n_blocks))
    pager.settle()
    dt = DeviceTable(table, torch.from_numpy(backend.arena), pack.blocks)
    moe = FusedMoE(spec, dt, pack.index)
    store = ExpertStore(pack)
    store.widths[:] = table.width
    gen = torch.Generator().manual_seed(1)
    layer = m.moe_layers[0]
    x = torch.randn(7, spec.hidden, generator=gen)
    weights, index = route(torch.randn(7, spec.num_experts, generator=gen), spec)
    scale = torch.sigmoid(torch.randn(7, 1, generator=gen)) if spec.shared_gate else None
    got = moe(layer, x, weights, index, scale)
    want = torch.zeros_like(x)
    for t in range(7):
        for s in range(spec.top_k):
            e = int(index[t, s])
            want[t] += weights[t, s] * store.mlp(layer, e, x[t : t + 1])[0]
        if spec.has_shared:
            shared = store.mlp(layer, spec.num_experts, x[t : t + 1])[0]
            want[t] += shared * (scale[t] if scale is not None else 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_synthetic_layer_reads_back_through_shuffled_slabs():
    spec = MoESpec(4, 2, 64, 96, "softmax_topk", False, 1.0, 32, True, "silu")
    layer = synthetic_layer(spec, device="cpu", seed=3)
    for b in range(layer.table.n_blocks):
        w8, w3 = layer.dt.weight(b, 8), layer.dt.weight(b, 3)
        assert torch.isfinite(w8).all() and w8.shape == (layer.blocks[b].rows, layer.blocks[b].cols)
        assert len(torch.unique(w3[0])) <= 8 < len(torch.unique(w8[0]))


# --- CUDA kernels (skipped without CUDA; run on the H200 before the kernel issue closes) --------


def _poison(moe: FusedMoE) -> None:
    junk = torch.full((64 << 20,), float("nan"), device="cuda")  # freed: fresh buffers see NaN
    del junk
    for hp in moe._hp.values():
        hp.fill_(float("nan"))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernels_match_reference(shape):
    layer = synthetic_layer(SHAPES[shape], seed=1)
    t = layer.table
    rng = np.random.default_rng(1)
    worst = {}
    for width in ["2", "3", "4", "5", "6", "7", "8", "mixed"]:
        w = rng.integers(t.min_bits, t.max_bits + 1, t.n_blocks) if width == "mixed" else int(width)
        layer.set_widths(np.broadcast_to(w, (t.n_blocks,)))
        for T in (1, 2, 3, 8, 9, 40, 512 if width in ("3", "mixed") else 33):
            x, weights, index, scale = random_routing(layer.spec, T, seed=T)
            want = layer.moe(0, x, weights, index, scale, reference=True)
            _poison(layer.moe)
            got = layer.moe(0, x, weights, index, scale)
            torch.cuda.synchronize()
            err = float((got - want).norm() / want.norm())
            worst[(width, T)] = err
            assert err < 1e-3, f"{shape} width {width} tokens {T}: relative error {err:.2e}"
    print(shape, "max relative error", max(worst.values()))


@pytest.mark.gpu
@pytest.mark.parametrize("T, k, E", [(1, 2, 8), (3, 4, 60), (8, 8, 128)])
def test_group_kernel_matches_torch_grouping(T, k, E):
    from pwctl.runtime.fused_moe import group_on_device

    spec = MoESpec(E, k, 64, 64, "softmax_topk", False, 1.0, 0, False, "silu")
    gen = torch.Generator(device="cuda").manual_seed(T)
    weights, index = route(torch.randn(T, E, generator=gen, device="cuda"), spec)
    want, got = group(index, weights, E), group_on_device(index, weights, E)
    for field in ("token", "weight", "lo", "hi"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    live = want.hi > want.lo  # empty slots may name any expert
    assert torch.equal(got.expert[live], want.expert[live])


def test_device_table_sync_uploads_what_changed():
    spec = MoESpec(4, 2, 64, 96, "softmax_topk", False, 1.0, 0, False, "silu")
    layer = synthetic_layer(spec, device="cpu", seed=2)
    t, dt = layer.table, layer.dt
    assert torch.equal(dt.width, torch.from_numpy(t.width.astype(np.int32)))
    t.width[3] = 4
    t.slab_map[[0, 1]] = t.slab_map[[1, 0]]
    dt.sync()
    assert torch.equal(dt.width, torch.from_numpy(t.width.astype(np.int32)))
    assert torch.equal(dt.slab_map, torch.from_numpy(t.slab_map))
    dt.sync()  # nothing changed: still equal
    assert torch.equal(dt.slab_map, torch.from_numpy(t.slab_map))
