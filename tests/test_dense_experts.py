"""The 16-bit expert backend (the fp16 policy's grouped GEMMs): its CPU twin equals the store's
reference experts on every architecture, the engine on it generates what the store engine does,
and its bytes count in the memory budget like planes."""

import pytest
import torch

from pwctl.build import tiny
from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.engine import Engine, experts_for, serving_dtype
from pwctl.runtime.engine.scheduler import SamplingParams
from pwctl.runtime.moe.block import MoEBlock
from pwctl.runtime.moe.dense_experts import DenseExperts
from pwctl.runtime.moe.router import route

FP16 = parse_policy("fp16")


@pytest.mark.parametrize("arch", tiny.ARCHS)
def test_dense_experts_equal_the_store_every_arch(arch, packs):
    pack = Pack(packs[(arch, "per_expert")])
    store = Engine(pack)
    store.set_policy(FP16)
    dense = DenseExperts(pack, "cpu", torch.float32)
    torch.manual_seed(0)
    for block in (m for m in store.model.modules() if isinstance(m, MoEBlock)):
        x = torch.randn(9, block.spec.hidden)
        weights, index = route(block.gate(x), block.spec)
        want = block._store_forward(x, weights, index)
        got = dense(block.layer, x, weights, index, block.shared_scale(x), block.bias())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_dense_engine_generates_what_the_store_engine_does(bundled_pack):
    pack = Pack(bundled_pack)
    store, dense = Engine(pack), Engine(pack, experts="dense")
    assert dense.experts == "dense"
    prompts = [store.tokenizer(p).input_ids for p in ("The earth was", "0123 4567", "And he")]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = []
    for engine in (store, dense):
        engine.start_batching(FP16, None, BatchConfig(max_seqs=2, max_batch_tokens=16))
        outs.append([s.output_ids for s in engine.generate_batch(prompts, params)])
    assert outs[0] == outs[1]


def test_dense_bytes_are_planes_in_the_budget(bundled_pack):
    pack = Pack(bundled_pack)
    engine = Engine(pack, experts="dense")
    cfg = BatchConfig(max_seqs=2, max_batch_tokens=16, max_model_len=64)
    batcher = engine.start_batching(FP16, None, cfg)
    fp16_bytes = sum(b.fp16_bytes for b in pack.blocks)
    assert batcher.memory.planes == fp16_bytes
    # every expert's weights are held once (the CPU twin in float32: twice the 16-bit bytes)
    assert engine.dense.nbytes == fp16_bytes * 2
    # the budget for 2 sequences of 64 tokens holds exactly their KV blocks
    budget = engine.fixed_bytes(cfg) + fp16_bytes + 2 * 4 * batcher.kv.block_bytes
    batcher = engine.start_batching(FP16, budget, cfg)
    assert batcher.kv.pool.capacity == 8


def test_fp16_runs_dense_in_bf16_on_cuda_and_the_store_on_cpu():
    assert experts_for(FP16, "cuda") == "dense" and experts_for(FP16, "cpu") == "store"
    assert experts_for(parse_policy("uniform:4"), "cuda:0") == "paged"
    assert serving_dtype("cuda", "dense") == torch.bfloat16
    assert serving_dtype("cuda", "paged") == torch.float16
    assert serving_dtype("cpu", "dense") == torch.float32


@pytest.mark.gpu
def test_dense_experts_on_cuda_match_the_cpu_twin_and_replay_in_a_graph(bundled_pack):
    """On CUDA (bf16, torch's fused grouped GEMM): the same function as the float32 twin to
    bf16 rounding, with no host sync (it captures in a CUDA graph and replays the same)."""
    pack = Pack(bundled_pack)
    cpu = DenseExperts(pack, "cpu", torch.float32)
    gpu = DenseExperts(pack, "cuda", torch.bfloat16)
    spec, layer = cpu.spec, pack.manifest.moe_layers[0]
    for T in (1, 4, 16, 512):
        x = torch.randn(T, spec.hidden)
        index = torch.stack([torch.randperm(spec.num_experts)[: spec.top_k] for _ in range(T)])
        weights = torch.rand(T, spec.top_k)
        want = cpu(layer, x, weights, index)
        xc, wc, ic = x.cuda(), weights.cuda(), index.cuda()
        got = gpu(layer, xc, wc, ic).float().cpu()
        err = (got - want).norm() / want.norm()
        assert err < 1e-2, (T, float(err))
        graph = torch.cuda.CUDAGraph()
        gpu(layer, xc, wc, ic)  # warm-up outside the capture
        with torch.cuda.graph(graph):
            out = gpu(layer, xc, wc, ic)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float().cpu(), got, rtol=0, atol=0)
