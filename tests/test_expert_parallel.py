"""Expert parallelism on CPU with gloo (issue 67): the placement balances router load with equal
expert counts; the exchange, in separate processes as torchrun would start them, gives every
rank the same MoE output as all experts on one rank, a rank with no tokens included; a rank that
dies makes the others fail with a clear error within the group's timeout, not hang. bench
--throughput on 2 ranks serves what one rank serves, request by request, and reports it
combined with a row a rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pwctl.errors import PwctlError
from pwctl.policy import parse_policy
from pwctl.runtime.parallel.placement import ExpertPlacement

WORKER = Path(__file__).with_name("expert_parallel_worker.py")
sys.path.insert(0, str(WORKER.parent))
import expert_parallel_worker as worker  # noqa: E402  # the reference shares its weights
from shared import free_port  # noqa: E402


def test_each_rank_takes_its_own_gpu_and_nccl(monkeypatch):
    """On CUDA a rank runs on its local GPU (LOCAL_RANK under torchrun, else RANK; rank 0, which
    starts the others, has neither) over NCCL; the CPU stays the CPU over gloo; fewer GPUs than
    ranks on the host, or a GPU named by hand, is refused before anything loads."""
    from pwctl.runtime.parallel import launch
    from pwctl.runtime.parallel.exchange import backend_for

    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for var in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert launch.rank_device("cpu", 2) == "cpu" and backend_for("cpu") == "gloo"
    assert launch.rank_device("cuda", 2) == "cuda:0"
    monkeypatch.setenv("RANK", "1")
    assert launch.rank_device("cuda", 2) == "cuda:1" and backend_for("cuda:1") == "nccl"
    monkeypatch.setenv("RANK", "5")  # torchrun on a second host: its local rank decides
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert launch.rank_device("cuda", 8) == "cuda:1"
    assert chosen == [0, 1, 1]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(PwctlError, match="4 ranks on this host, 2 GPU"):
        launch.rank_device("cuda", 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(PwctlError, match="each rank takes its own GPU"):
        launch.rank_device("cuda:0", 8)


def test_placement_balances_load_with_equal_counts():
    rng = np.random.default_rng(0)
    load = rng.pareto(1.5, size=(3, 60)) + 0.01  # a few hot experts, as routers have
    p = ExpertPlacement.balanced(load, 4)
    for layer in range(3):
        assert sorted(np.bincount(p.owner[layer], minlength=4)) == [15] * 4
        assert np.array_equal(np.sort(np.concatenate([p.local(r, layer) for r in range(4)])),
                              np.arange(60))  # fmt: skip
    shares = p.rank_load(load) / load.sum(1, keepdims=True)
    contiguous = ExpertPlacement(np.repeat(np.arange(4), 15)[None].repeat(3, 0), 4)
    naive = contiguous.rank_load(load) / load.sum(1, keepdims=True)
    hottest = (load / load.sum(1, keepdims=True)).max(1)
    assert shares.max() < naive.max()
    assert (shares.max(1) <= 1 / 4 + hottest).all()  # greedy's bound: a fair share + one expert
    with pytest.raises(PwctlError, match="needs 1 to 60 ranks"):
        ExpertPlacement.balanced(load, 61)


def _ranks(world: int, out: Path, mode: str, *extra: str) -> list[subprocess.CompletedProcess]:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), port, str(out), mode, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    done = []
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return done


def _reference(x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, layer: int):
    w = worker.experts()[layer]
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for s in range(index.shape[1]):
            out[t] += weights[t, s] * worker.mlp(w[int(index[t, s])], x[t : t + 1])[0]
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_get_the_one_rank_output(world, tmp_path):
    runs = _ranks(world, tmp_path, "ok")
    assert all(r.returncode == 0 for r in runs), [r.stdout for r in runs]
    for rank in range(world):
        got = load_file(str(tmp_path / f"rank{rank}.st"))
        assert got["x"].shape[0] == worker.TOKENS[rank]
        for layer in range(worker.LAYERS):
            want = _reference(got["x"], got["weights"], got["index"], layer)
            torch.testing.assert_close(got[f"out{layer}"], want, rtol=1e-5, atol=1e-5)
    assert "sent 0 bytes" not in runs[0].stdout  # tokens really travelled


def test_a_dead_rank_fails_the_others_within_the_timeout(tmp_path):
    start = time.monotonic()
    runs = _ranks(2, tmp_path, "die")
    assert time.monotonic() - start < 60
    assert runs[1].returncode == 0
    assert runs[0].returncode == 3 and "expert exchange failed" in runs[0].stdout, runs[0].stdout


@pytest.fixture(scope="module", params=["store", "paged"])
def two_ranks_served(request, bundled_pack, tmp_path_factory) -> dict:
    """Each rank's prompts served by 2 gloo ranks, each engine on its share of the pack (the
    worker's "store" / "paged" modes), beside one engine of the whole pack serving the same
    prompts: {"experts", "ranks": what each rank saved, "one": one engine's, a rank's prompts
    each}."""
    experts, out = request.param, tmp_path_factory.mktemp(f"two-ranks-{request.param}")
    runs = _ranks(2, out, experts, str(bundled_pack))
    assert all(r.returncode == 0 for r in runs), [r.stdout[-2000:] for r in runs]
    prompts = [worker.rank_prompts(rank, 2) for rank in range(2)]
    return {
        "experts": experts,
        "ranks": [load_file(str(out / f"rank{rank}.st")) for rank in range(2)],
        "one": [worker.serve(str(bundled_pack), p, experts=experts) for p in prompts],
    }


def test_engines_on_two_ranks_serve_what_one_engine_serves(two_ranks_served):
    """Each rank serves its own prompts (uneven: one rank runs out of work first and keeps
    joining the exchanges with no tokens); greedy tokens equal one engine's, and the first
    step's logits agree in float32 within 1e-4; owners run what they receive on the store, or
    on the paged experts' fused MoE in one call (its torch path on the CPU)."""
    for got, want in zip(two_ranks_served["ranks"], two_ranks_served["one"], strict=True):
        assert torch.equal(got["tokens"], want["tokens"])
        torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=1e-4)


def test_each_rank_holds_the_planes_of_its_own_experts_only(two_ranks_served, bundled_pack):
    """Item 1 of issue 67: a rank's engine holds (host copy, device slabs, the memory budget's
    and /metrics' plane bytes) and reads from the page files only the blocks of the experts its
    placement gives it, half of tiny-mixtral's (no shared expert) on each of 2 ranks, and still
    serves one engine's greedy tokens."""
    from pwctl.format.pack import Pack

    pack = Pack(bundled_pack)
    placement = ExpertPlacement.for_pack(pack, 2)
    (one, _), ranks = two_ranks_served["one"], two_ranks_served["ranks"]
    assert one["held"].all()
    for rank, got in enumerate(ranks):
        held = got["held"].numpy()
        assert np.array_equal(held, placement.holds(rank, pack.blocks)) and held.mean() == 0.5
        assert set(got["loaded"].tolist()) <= set(np.flatnonzero(held).tolist())  # none vacant
        if two_ranks_served["experts"] == "store":  # read as the exchange brought tokens
            assert got["loaded"].numel() > 0
        for key in ("plane_bytes", "host_bytes"):  # the owned share of one engine's bytes
            assert int(got[key]) == int(one[key]) // 2
    assert not (ranks[0]["held"] & ranks[1]["held"]).any()  # each block on one rank
    for got, want in zip(ranks, two_ranks_served["one"], strict=True):
        assert torch.equal(got["tokens"], want["tokens"])


def test_before_the_ranks_join_a_rank_runs_its_own_experts_only():
    """The exchange an engine on a rank's share starts with (the start-up probe of its largest
    step runs before RankEngine): every (token, expert) pair goes to one of this rank's experts,
    one row a pair, as an owner would run them; no collective."""
    from pwctl.runtime.parallel.exchange import SelfExchange

    load = np.random.default_rng(0).random((2, 6))
    placement = ExpertPlacement.balanced(load, 2)
    x, weights, index = worker.tokens(0)  # 5 tokens, top-2 of 6 experts
    seen = []

    def run(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        seen.append(experts)
        return rows * (1 + experts[:, None])

    for rank, layer in ((0, 0), (1, 1)):
        out = SelfExchange(placement, rank)(layer, x, weights, index, run)
        mine = set(placement.local(rank, layer).tolist())
        assert seen[-1].numel() == index.numel() and set(seen[-1].tolist()) <= mine
        scale = (weights * (1 + seen[-1].view(index.shape))).sum(1, keepdim=True)
        torch.testing.assert_close(out, x * scale)


@pytest.mark.parametrize("experts", ["store", "paged"])
def test_a_ranks_share_never_reads_another_ranks_blocks(experts, bundled_qwen_pack):
    """On a rank's share of tiny-qwen-moe (32 experts and a shared one) the other rank's routed
    experts are vacant: no plane bytes anywhere (store, page table, host copy, memory budget)
    and a read of one is an error; shared blocks are every rank's. The engine runs before the
    ranks join (the start-up probe, here its reference forward) on this rank's blocks alone."""
    from pwctl.format.pack import Pack
    from pwctl.runtime.engine.batcher import BatchConfig
    from pwctl.runtime.engine.engine import Engine
    from pwctl.runtime.parallel.rank_pack import RankPack, rank_pack

    pack, policy = Pack(bundled_qwen_pack), parse_policy("uniform:4")
    for kept in (parse_policy("fp16"), policy):  # fp16: not planes; one rank: all of them
        assert rank_pack(pack, 2 if kept.bits is None else 1, 0, kept) is pack
    share = rank_pack(pack, 2, 1, policy)
    assert isinstance(share, RankPack)
    shared = np.array([b.shared for b in pack.blocks])
    assert share.held[shared].all() and share.held[~shared].mean() == 0.5
    whole, engine = Engine(pack, experts=experts), Engine(share, experts=experts)
    ids = torch.tensor([[5, 17, 3, 99, 42, 7, 8, 1]])
    assert torch.isfinite(engine.logits(ids)).all()
    assert set(engine.store.loaded_blocks) <= set(np.flatnonzero(share.held).tolist())
    assert set(np.flatnonzero(shared).tolist()) <= set(engine.store.loaded_blocks)
    vacant = int(np.flatnonzero(~share.held)[0])
    with pytest.raises(PwctlError, match="is rank 0's expert, not rank 1's"):
        engine.store.weight_at(vacant, 4)
    held_bytes = sum(b.bytes_at(4) for b, h in zip(pack.blocks, share.held, strict=True) if h)
    cfg = BatchConfig(max_seqs=2)
    mine = engine.start_batching(policy, None, cfg).metrics()["plane_bytes"]
    assert whole.start_batching(policy, None, cfg).metrics()["plane_bytes"] > mine
    if experts == "store":
        assert mine == held_bytes
    else:  # the same slabs as the whole pack's, for the held blocks only
        t, w = engine.paged.table, whole.paged.table
        assert t.slab_bytes == w.slab_bytes and t.plane_slabs[~share.held].sum() == 0
        assert t.host_bytes == int(w.plane_slabs[share.held].sum()) * w.slab_bytes
        assert mine == int(w.cost_at[share.held, 4].sum())


@pytest.mark.parametrize("experts", ["store", "paged"])
def test_a_ranks_planner_plans_its_own_blocks_only(experts, bundled_pack):
    """A budgeted policy on a rank's share: the planner, BUDGET and the memory budget count the
    blocks held there only (half of tiny-mixtral's), so under the same --memory-budget a rank's
    planes may be wider than one engine's; the other rank's blocks never move."""
    from pwctl.format.pack import Pack
    from pwctl.runtime.engine.batcher import BatchConfig
    from pwctl.runtime.engine.engine import Engine
    from pwctl.runtime.parallel.rank_pack import rank_pack

    pack, policy = Pack(bundled_pack), parse_policy("pagedweight:0.3")
    share = rank_pack(pack, 2, 0, policy)
    cfg, budget = BatchConfig(max_seqs=2), 165_000_000
    one = Engine(pack, experts=experts).start_batching(policy, budget, cfg)
    engine = Engine(share, experts=experts)
    mine = engine.start_batching(policy, budget, cfg)
    assert engine.allocator is not None
    assert engine.allocator.planner.n == share.held.sum() == len(pack.blocks) // 2
    assert engine.allocator.budget == one.memory.allocator.budget // 2
    held_widest = sum(b.bytes_at(6) for b, h in zip(pack.blocks, share.held, strict=True) if h)
    assert mine.memory.planes <= held_widest and mine.memory.planes < one.memory.planes
    vacant = engine.store.widths[~share.held]
    assert (vacant == engine.store.max_bits).all()  # no bytes at any width: never planned
    assert set(mine.metrics()["widths_per_layer"]) == {0, 1, 2}


def test_placement_of_a_pack_without_a_profile_is_uniform(bundled_qwen_pack):
    from pwctl.format.pack import Pack

    p = ExpertPlacement.for_pack(Pack(bundled_qwen_pack), 4)  # tiny-qwen-moe: 32 experts
    assert p.owner.shape[1] == 32 and (np.bincount(p.owner[0], minlength=4) == 8).all()


def test_generate_with_two_ranks_prints_what_one_rank_prints(bundled_pack, tmp_path):
    """`pwctl generate --expert-parallel 2` starts its second rank itself (an owner of half the
    experts) and writes the completion one rank writes."""
    out = {}
    for n in (1, 2):
        json_path = tmp_path / f"g{n}.json"
        cmd = [sys.executable, "-m", "pwctl.cli", "generate", str(bundled_pack), "--prompt",
               "In the beginning", "--max-tokens", "8", "--device", "cpu", "--policy",
               "uniform:4", "--expert-parallel", str(n), "--json", str(json_path)]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        out[n] = json.loads(json_path.read_text())
    assert out[2]["completion"] == out[1]["completion"] and out[2]["tokens"] == 8
    ep = out[2]["expert_parallel"]  # rank 0's side: every layer of every step exchanged
    assert out[1]["expert_parallel"] is None and ep["ranks"] == 2
    assert ep["exchanges"] >= 3 * 8 and ep["sent_bytes"] > 0 and ep["seconds"] > 0
    # every rank's metrics, gathered on rank 0: the owner ran the same exchanges, with no KV
    # cache in use (no requests of its own) and, at uniform:4, every layer at 4 bits
    (first, owner) = ep["per_rank"]
    assert (first["rank"], owner["rank"]) == (0, 1)
    assert first["exchange"]["calls"] == owner["exchange"]["calls"] == ep["exchanges"]
    assert first["exchange"]["sent_bytes"] == ep["sent_bytes"] and owner["exchange"]["sent_bytes"]
    for r in (first, owner):
        assert r["plane_bytes"] > 0 and r["kv_bytes"] == r["kv_blocks_used"] == 0  # all done
        assert set(r["widths_per_layer"].values()) == {4.0} and r["width_moves"] == 0


def test_throughput_on_two_ranks_serves_what_one_rank_serves(bundled_pack, tmp_path):
    """Each rank serves every other request of a batch and of a closed loop (its share in
    flight); the combined rows count the tokens one rank's rows count, and every request's
    greedy tokens are the same."""
    runs = _ranks(2, tmp_path, "bench", str(bundled_pack))
    assert all(r.returncode == 0 for r in runs), [r.stdout[-2000:] for r in runs]
    ranked = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    single = worker.bench(str(bundled_pack))
    for load, (want_rows, want_tokens) in enumerate(single):
        (want,), (got,) = want_rows, ranked[0][load][0]
        for key in ("requests", "output_tokens", "prompt_tokens", "requested_tokens"):
            assert got[key] == want[key], key
        assert got["output_tokens"] == want["requests"] * worker.BENCH_OUT and got["cut_short"] == 0
        rows = got["ranks"]
        assert [r["rank"] for r in rows] == [0, 1] and [r["requests"] for r in rows] == [2, 1]
        assert sum(r["output_tokens"] for r in rows) == got["output_tokens"]
        assert got["output_tok_s"] == pytest.approx(got["output_tokens"] / got["seconds"])
        calls = [r["exchange"]["calls"] for r in rows]  # the measured run's (3 MoE layers)
        assert calls[0] == calls[1] and calls[0] % 3 == 0  # in step: every rank, every layer
        assert calls[0] >= 3 * max(r["steps"] for r in rows) > 0
        assert all(r["exchange"]["sent_bytes"] > 0 for r in rows)
        assert ranked[1][load][0][0]["ranks"] is None  # rank 1 reports nothing combined
        served = {**ranked[0][load][1], **ranked[1][load][1]}
        assert set(ranked[0][load][1]).isdisjoint(ranked[1][load][1])  # each request once
        assert served == want_tokens and len(served) == want["requests"]


def test_bench_throughput_with_two_ranks_reports_each_rank(bundled_pack, tmp_path):
    """`pwctl bench --throughput --expert-parallel 2` starts its second rank itself; rank 0
    prints the combined row and a row a rank, and writes them to --json."""
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "pwctl.cli", "bench", str(bundled_pack), "--throughput",
           "--input-len", "24", "--output-len", "4", "--batch", "2", "--policy", "uniform:4",
           "--device", "cpu", "--expert-parallel", "2", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "uniform:4 x2 ranks" in r.stdout and "expert-parallel ranks" in r.stdout
    (row,) = json.loads(out.read_text())["results"]
    assert (row["requests"], row["output_tokens"], row["cut_short"]) == (2, 8, 0)
    assert [(r["rank"], r["requests"], r["output_tokens"]) for r in row["ranks"]] == [
        (0, 1, 4), (1, 1, 4)]  # fmt: skip
    for rank in row["ranks"]:
        assert 0 < rank["peak_memory_bytes"] <= rank["memory_budget_bytes"]
        assert rank["exchange"]["calls"] > 0 and rank["exchange"]["seconds"] > 0
        assert rank["peak_kv_bytes"] > rank["kv_bytes"] == 0  # the cache held blocks, then none
        assert rank["plane_bytes"] == rank["peak_plane_bytes"] > 0  # uniform:4: planes fixed
        assert set(rank["widths_per_layer"].values()) == {4.0} and rank["width_moves"] == 0
    assert row["peak_memory_bytes"] == max(r["peak_memory_bytes"] for r in row["ranks"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "2", "--expert-parallel", "0"], "--expert-parallel 0: must be at least 1"),
        (["--load", "bursty", "--expert-parallel", "2"], "--batch and --concurrency loads only"),
        (["--concurrency", "1", "--expert-parallel", "2"], "the concurrency needs at least 2"),
        (
            ["--batch", "2", "--quality-sample", "2", "--expert-parallel", "2"],
            "--quality-sample does not run with --expert-parallel",
        ),  # fmt: skip
    ],
)
def test_bench_expert_parallel_bad_input_exits_2_before_any_rank_starts(
    bundled_pack, args, message
):
    from typer.testing import CliRunner

    from pwctl.cli import app

    r = CliRunner().invoke(app, ["bench", str(bundled_pack), "--throughput", "--input-len", "8",
                                 "--output-len", "2", "--device", "cpu", *args])  # fmt: skip
    assert r.exit_code == 2 and message in r.output, r.output


def test_serve_with_two_ranks_answers_over_http_and_fails_cleanly_when_a_rank_dies(bundled_pack):
    """`pwctl serve --expert-parallel 2`: rank 0's front end gives two concurrent requests to
    the two ranks (the least loaded each); both get one rank's greedy completion, /metrics has
    each rank's figures, and once rank 1 is killed the server says down and refuses with 503
    instead of hanging."""
    import concurrent.futures
    import signal

    import httpx
    from shared import served

    from pwctl.format.pack import Pack
    from pwctl.runtime.engine.engine import Engine

    engine = Engine(Pack(bundled_pack))
    engine.set_policy(parse_policy("uniform:4"))
    # a long request and a short one: the second to arrive finds the first still running
    asks = list(zip(worker.PROMPTS[:2], (48, 8), strict=True))
    want = [engine.tokenizer.decode(engine.generate_ids(engine.tokenizer(p).input_ids, n),
                                    skip_special_tokens=True) for p, n in asks]  # fmt: skip
    with served(bundled_pack, "--policy", "uniform:4", "--expert-parallel", "2") as url:

        def complete(prompt: str, n: int = 8) -> httpx.Response:
            body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0}
            return httpx.post(url + "/v1/completions", json=body, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(complete, *zip(*asks, strict=True)))
        assert [r.json()["choices"][0]["text"] for r in got] == want
        metrics = httpx.get(url + "/metrics").text
        calls = [_metric(metrics, "pwctl_rank_exchange_calls_total", r) for r in (0, 1)]
        assert calls[0] == calls[1] > 0  # in step: every rank joined every exchange
        tokens = [_metric(metrics, "pwctl_rank_generated_tokens_total", r) for r in (0, 1)]
        assert sorted(tokens) == [8, 48]  # a request each: the second went to the idle rank
        assert _metric(metrics, "pwctl_rank_plane_bytes", 1) > 0
        assert 'pwctl_rank_layer_width_bits{layer="0",rank="1"} 4.0' in metrics
        # streamed: the same text, piece by piece, from whichever rank took it
        body = {"model": "m", "prompt": asks[1][0], "max_tokens": 8, "temperature": 0,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]" and len(events) > 2
        pieces = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
        assert "".join(pieces) == want[1]
        os.kill(_started_rank(url.rsplit(":", 1)[1]), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").json()["status"] != "down":
            assert time.monotonic() < deadline, "the front end did not notice the dead rank"
            time.sleep(0.2)
        r = complete(asks[0][0])
        assert r.status_code == 503 and "expert-parallel serving stopped" in r.text


def _started_rank(port: str) -> int:
    """The pid of the rank that the server on `port` started (its child running serve_rank)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            parent_cmd = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if b"pwctl.commands.serve_rank" in cmd and port.encode() in parent_cmd:
            found.append(int(pid))
    (pid,) = found
    return pid


def _metric(text: str, name: str, rank: int) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith(f'{name}{{rank="{rank}"}}')]
    return float(line.rsplit(" ", 1)[1])


def test_serve_expert_parallel_bad_input_exits_2_before_the_model_loads(bundled_pack):
    from typer.testing import CliRunner

    from pwctl.cli import app

    r = CliRunner().invoke(app, ["serve", str(bundled_pack), "--expert-parallel", "0"])
    assert r.exit_code == 2 and "--expert-parallel 0: must be at least 1" in r.output, r.output
