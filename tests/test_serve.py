"""pwctl serve end to end: the real `openai` client against a server started in the test
(uvicorn in a thread, free port) on the bundled tiny-mixtral, CPU."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from shared import free_port

from pwctl.format.pack import Pack
from pwctl.policy import parse_policy
from pwctl.runtime.engine.batcher import BatchConfig
from pwctl.runtime.engine.engine import Engine
from pwctl.runtime.engine.scheduler import QueueFull, SamplingParams
from pwctl.runtime.serve.protocol import chat_prompt
from pwctl.runtime.serve.server import _engine_error, create_app
from pwctl.runtime.serve.worker import EngineWorker, Request, Update

KEY = "test-key"
PROMPTS = [
    "In the beginning God created",
    "The quick brown fox",
    "It is a truth universally acknowledged",
    "And the earth was without form",
    "Call me Ishmael.",
    "To be, or not to be,",
    "The Lord is my shepherd",
    "Four score and seven years ago",
]


class Server:
    """uvicorn + the engine thread, in the background, on a free local port."""

    def __init__(self, engine: Engine, api_key: str | None = None, **options):
        self.port = free_port()
        self.worker = EngineWorker(engine)
        app = create_app(self.worker, "tiny-mixtral", api_key, **options)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.worker.start()
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.worker.stop()

    def client(self, key: str | None = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", **kw)

    def metrics(self, key: str = KEY) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
        out = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@pytest.fixture(scope="module")
def served(bundled_pack):
    """A server with an API key at uniform:4, and the reference path's greedy outputs."""
    engine = Engine(Pack(bundled_pack))
    engine.set_policy(parse_policy("uniform:4"))
    tok = engine.tokenizer
    expected = {}
    for p in PROMPTS:
        ids = engine.generate_ids(tok(p).input_ids, 12)
        expected[p] = tok.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "Who made the heavens?"}]
    chat_ids = engine.generate_ids(tok(chat_prompt(chat, tok)).input_ids, 12)
    expected["chat"] = tok.decode(chat_ids, skip_special_tokens=True)
    cfg = BatchConfig(max_seqs=6, max_batch_tokens=64, max_queue=16, max_model_len=256)
    engine.start_batching(parse_policy("uniform:4"), None, cfg)
    with Server(engine, KEY) as server:
        yield server, expected, chat


def test_completions_greedy_equal_reference(served):
    server, expected, _ = served
    client = server.client()
    r = client.completions.create(
        model="tiny-mixtral", prompt=PROMPTS[0], max_tokens=12, temperature=0
    )
    assert r.choices[0].text == expected[PROMPTS[0]]
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert [m.id for m in client.models.list().data] == ["tiny-mixtral"]


def test_chat_and_streaming(served):
    server, expected, chat = served
    client = server.client()
    r = client.chat.completions.create(
        model="tiny-mixtral", messages=chat, max_tokens=12, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected["chat"]
    chunks = list(
        client.chat.completions.create(
            model="tiny-mixtral", messages=chat, max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["chat"]
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    stream = client.completions.create(
        model="tiny-mixtral",
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = list(stream)
    assert "".join(c.choices[0].text for c in parts if c.choices) == expected[PROMPTS[1]]
    assert parts[-1].usage.completion_tokens == 12 or parts[-2].choices[0].finish_reason == "stop"
    # stop strings end the text before them; sampling with a seed runs
    text = expected[PROMPTS[2]]
    cut = text[3:5]
    r = client.completions.create(
        model="m", prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=[cut]
    )
    assert r.choices[0].text == text[: text.find(cut)] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="m", prompt=PROMPTS[2], max_tokens=8, temperature=0.8, top_p=0.9, seed=1
    )
    assert r.usage.completion_tokens >= 1


def test_sixteen_concurrent_clients_get_reference_outputs(served):
    server, expected, _ = served
    client = server.client()

    def ask(i: int) -> tuple[str, str]:
        p = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            s = client.completions.create(
                model="m", prompt=p, max_tokens=12, temperature=0, stream=True
            )
            return p, "".join(c.choices[0].text for c in s)
        r = client.completions.create(model="m", prompt=p, max_tokens=12, temperature=0)
        return p, r.choices[0].text

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(16)))
    assert all(text == expected[p] for p, text in results)
    m = server.metrics()
    assert m["pwctl_kv_blocks_used"] == 0 and m["pwctl_generated_tokens_total"] >= 16 * 12 - 16


def test_disconnect_mid_stream_frees_blocks(served):
    server, _, _ = served
    before = server.metrics()["pwctl_aborted_total"]
    stream = server.client().completions.create(
        model="m", prompt=PROMPTS[3], max_tokens=200, temperature=0, stream=True
    )
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    assert server.metrics()["pwctl_kv_blocks_used"] > 0
    stream.close()
    _assert_aborted_and_freed(server, before)


def test_disconnect_while_waiting_for_a_full_response_frees_blocks(served):
    server, _, _ = served
    before = server.metrics()["pwctl_aborted_total"]
    body = {"prompt": PROMPTS[5], "max_tokens": 200, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=0.3)
    _assert_aborted_and_freed(server, before)


def test_bad_requests_get_400_and_server_keeps_serving(served):
    server, expected, _ = served
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = server.url + "/v1/completions"
    bad = [
        (b"{not json", None),
        (json.dumps({"prompt": "hi", "max_tokens": "ten"}), "max_tokens"),
        (json.dumps({"prompt": "hi", "max_tokens": -3}), "max_tokens"),
        (json.dumps({"prompt": "hi", "max_tokens": 10**12}), "max_tokens"),
        (json.dumps({"prompt": "hi", "max_tokens": True}), "max_tokens"),
        (json.dumps({"prompt": 42}), "prompt"),
        (json.dumps({"prompt": "hi", "temperature": "hot"}), "temperature"),
        (json.dumps({"prompt": "hi", "seed": 2**64}), "seed"),  # no generator takes it
        (json.dumps({"prompt": "the earth " * 400}), "prompt"),
        (json.dumps({"prompt": [10**9]}), "prompt"),
        (json.dumps([1, 2]), None),
    ]
    for body, param in bad:
        r = httpx.post(url, content=body, headers=headers)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["param"] == param and err["type"] == "invalid_request_error"
    r = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": [{"role": "x"}]}, headers=headers
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0]"
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="m", prompt="hi", max_tokens=-1)
    assert e.value.status_code == 400
    assert httpx.get(server.url + "/nowhere", headers=headers).json()["error"]["type"]
    r = server.client().completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=12, temperature=0
    )
    assert r.choices[0].text == expected[PROMPTS[0]]


def test_api_key_is_enforced(served):
    server, _, _ = served
    for key in (None, "wrong"):
        with pytest.raises(openai.AuthenticationError):
            server.client(key).completions.create(model="m", prompt="hi", max_tokens=2)
    models = server.url + "/v1/models"
    assert httpx.get(models).status_code == 401
    for header in (f"Basic {KEY}", f"Bearer{KEY}", f"Bearer {KEY}x", KEY):
        assert httpx.get(models, headers={"Authorization": header}).status_code == 401, header
    for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme in any case (RFC 9110)
        r = httpx.get(models, headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, scheme


def test_health_and_metrics_are_open_unless_asked(served):
    """Load balancers and Prometheus carry no API key; --metrics-auth closes /metrics."""
    server, _, _ = served
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert "pwctl_steps_total" in httpx.get(server.url + "/metrics").text
    closed = TestClient(create_app(server.worker, "m", KEY, metrics_auth=True))
    assert closed.get("/metrics").status_code == 401
    assert closed.get("/health").status_code == 200
    ok = closed.get("/metrics", headers={"Authorization": f"bearer {KEY}"})
    assert ok.status_code == 200 and "pwctl_steps_total" in ok.text


def _post_chunks(app, chunks: list[bytes], headers=()) -> tuple[int, int]:
    """POST /v1/completions straight through ASGI, the body in `chunks`: (status, body bytes
    the app read)."""
    state = {"read": 0, "status": 0}
    pending = list(chunks)

    async def receive():
        if pending:
            chunk = pending.pop(0)
            state["read"] += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
        await asyncio.sleep(3600)  # the client stays connected

    async def send(message):
        if message["type"] == "http.response.start":
            state["status"] = message["status"]

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1), "headers": [(b"content-type", b"application/json"), *headers],
    }  # fmt: skip
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    return state["status"], state["read"]


def test_request_body_limit_answers_413_before_reading_the_rest(served):
    server, _, _ = served
    app = create_app(server.worker, "m", max_request_bytes=4096)
    chunk = b" " * 1024
    status, read = _post_chunks(app, [chunk] * 1000)  # chunked: no length announced
    assert status == 413 and read <= 4096 + len(chunk)
    announced = [(b"content-length", str(len(chunk) * 1000).encode())]
    status, read = _post_chunks(app, [chunk] * 1000, announced)
    assert status == 413 and read == 0
    r = TestClient(app).post("/v1/completions", content=b'{"prompt": "' + b"a" * 5000 + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    small = TestClient(app).post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2})
    assert small.status_code == 200


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_memory_of_a_refused_large_request_is_released(served):
    """A 1.5 MB prompt (under the body limit, over the context) is tokenized and refused; the
    heap its tokenization took goes back to the system (glibc kept it: RSS grew ~1 GB and
    stayed after a few such requests)."""
    server, _, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    url = server.url + "/v1/completions"
    for _ in range(3):  # both tokenizing threads have their tokenizer
        httpx.post(url, json={"prompt": "hi", "max_tokens": 1}, headers=headers, timeout=60)
    gc.collect()
    before = _rss_mb()
    big = {"prompt": "the earth was without form " * 55000}  # 1.5 MB
    r = httpx.post(url, json=big, headers=headers, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    deadline, grown = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        grown = _rss_mb() - before
        if grown < 60:
            break
        time.sleep(0.2)
    assert grown < 60, f"RSS still {grown:.0f} MB above where it was"


def test_overload_gets_429_never_a_crash(served):
    server, expected, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": PROMPTS[4], "max_tokens": 24, "temperature": 0}

    def post(_: int) -> int:
        return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=120)

    with ThreadPoolExecutor(40) as pool:
        codes = [r.status_code for r in pool.map(post, range(40))]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    r = server.client().completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=12, temperature=0
    )
    assert r.choices[0].text == expected[PROMPTS[0]]


def test_small_memory_budget_demotes_during_long_requests_and_promotes_after(bundled_pack):
    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_seqs=8, max_batch_tokens=64, block_size=8, max_model_len=128)
    probe = engine.start_batching(parse_policy("pagedweight:0.4"), None, cfg)
    full = probe.memory.fixed + engine.widest_plane_bytes()
    budget = full + 10 * probe.kv.block_bytes  # widest planes leave room for 10 blocks
    engine.start_batching(parse_policy("pagedweight:0.4"), f"{budget}B", cfg)
    with Server(engine) as server:
        client = server.client(max_retries=0)
        start = server.metrics()
        assert start["pwctl_kv_blocks_limit"] == 10

        def ask(i: int):
            p = PROMPTS[i % len(PROMPTS)]
            r = client.completions.create(model="m", prompt=p, max_tokens=56, temperature=0)
            return r.choices[0].finish_reason, r.usage.completion_tokens

        seen, done = [], threading.Event()

        def watch() -> None:  # the metrics while the requests run
            while not done.is_set():
                seen.append(server.metrics())
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ask, range(8)))
        done.set()
        watcher.join()
        assert all(r == ("length", 56) for r in results)  # no request failed
        loaded = server.metrics()
        assert loaded["pwctl_width_demotions_total"] > 0
        assert loaded["pwctl_width_demoted_bytes_total"] > 0
        assert max(x["pwctl_kv_blocks_limit"] for x in seen) > 10  # KV took plane memory
        low = min(x["pwctl_plane_bytes"] for x in seen + [loaded])
        assert low < start["pwctl_plane_bytes"]
        deadline = time.monotonic() + 15  # idle: the planner's cooldown runs out, planes return
        while time.monotonic() < deadline:  # (promotions may also come during the load, once
            m = server.metrics()  # squeezed floors are back: wait for the planes themselves)
            if m["pwctl_width_promotions_total"] > 0 and m["pwctl_plane_bytes"] > low:
                break
            time.sleep(0.1)
        assert m["pwctl_width_promotions_total"] > 0 and m["pwctl_width_promoted_bytes_total"] > 0
        assert m["pwctl_plane_bytes"] > low
        assert m["pwctl_kv_blocks_used"] == 0 and 'pwctl_layer_width_bits{layer="0"}' in m


def _assert_aborted_and_freed(server, before: int) -> None:
    """Within 10 s the engine counts one more abort and holds no KV block."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["pwctl_aborted_total"] > before and m["pwctl_kv_blocks_used"] == 0:
            break
        time.sleep(0.05)
    assert m["pwctl_aborted_total"] == before + 1 and m["pwctl_kv_blocks_used"] == 0


def test_full_queue_is_429_wherever_it_is_found(bundled_pack):
    """A request counts as pending until the engine thread has queued it, and both counts change
    in one update, so the bound holds between metric snapshots (a request that slipped through
    was refused later by the scheduler: HTTP 503 under load). A queue found full by the engine
    thread anyway (preemptions refill it) answers 429, like a full queue at submit."""
    engine = Engine(Pack(bundled_pack))
    cfg = BatchConfig(max_queue=3, max_model_len=128)
    engine.start_batching(parse_policy("uniform:4"), None, cfg)
    worker = EngineWorker(engine)  # not started: the test plays the engine thread
    loop = asyncio.new_event_loop()
    try:
        params = SamplingParams(max_tokens=2)
        for _ in range(3):
            worker.submit(Request([1, 2, 3], params, loop))
        with pytest.raises(QueueFull):
            worker.submit(Request([1, 2, 3], params, loop))
        worker._handle(*worker.inbox.get_nowait())  # queued, no metrics snapshot published yet
        assert worker._pending == 2 and worker.metrics()["queue_length"] == 1
        with pytest.raises(QueueFull):
            worker.submit(Request([1, 2, 3], params, loop))
    finally:
        loop.close()
    busy = _engine_error(Update("", 0, "abort", error="busy: the waiting queue is full"))
    assert (busy.status, busy.kind) == (429, "rate_limit_error")
    assert _engine_error(Update("", 0, "abort", error="engine error: boom")).status == 500


class _HeldTokenizer:
    """The pack's tokenizer, except that a prompt containing HOLD waits for `release` (set by
    the test) once it has signalled `entered`."""

    def __init__(self, real, entered: threading.Event, release: threading.Event):
        self.real, self.entered, self.release = real, entered, release

    def __call__(self, text, *args, **kwargs):
        if "HOLD" in text:
            self.entered.set()
            assert self.release.wait(120)
        return self.real(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_health_and_other_requests_go_on_while_a_prompt_is_tokenized(bundled_pack):
    """Structural, not timed: one request's tokenization is held on an event the test
    controls; meanwhile /health answers and another request runs to completion."""
    engine = Engine(Pack(bundled_pack))
    engine.start_batching(parse_policy("uniform:4"), None, BatchConfig(max_model_len=128))
    entered, release = threading.Event(), threading.Event()

    def load():
        return _HeldTokenizer(engine.tokenizer.__class__.from_pretrained(bundled_pack),
                              entered, release)  # fmt: skip

    with Server(engine, load_tokenizer=load) as server, ThreadPoolExecutor(1) as pool:
        body = {"prompt": "HOLD the earth", "max_tokens": 3}
        held = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=120)
        try:
            assert entered.wait(60)
            health = httpx.get(server.url + "/health", timeout=30)
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            other = server.client().completions.create(
                model="m", prompt=PROMPTS[1], max_tokens=4, temperature=0
            )
            assert other.usage.completion_tokens == 4 and not held.done()
        finally:
            release.set()
        assert held.result().status_code == 200


def _corrupt(pack_dir, block, plane: int) -> None:
    page = pack_dir / block.file
    data = bytearray(page.read_bytes())
    data[block.planes[plane].offset + 5] ^= 0xFF
    page.write_bytes(bytes(data))


def test_a_failed_checksum_turns_health_to_503_and_keeps_the_last_good_width(
    bundled_pack, tmp_path, caplog
):
    """Verified at start: plane 4 of one block is bad, so that block serves 4 bits (its
    last good width) under uniform:6; /health is 503 and names it, the log too."""
    pack_dir = tmp_path / "pack"
    shutil.copytree(bundled_pack, pack_dir)
    pack = Pack(pack_dir)
    block = pack.blocks[7]
    _corrupt(pack_dir, block, 4)
    faults = pack.verify()
    assert [(f.block, f.plane) for f in faults] == [(block.name, 4)]
    engine = Engine(pack)
    with caplog.at_level("ERROR", logger="pwctl"):
        engine.store.add_faults(faults)
    assert block.name in caplog.text and "served at 4 bits at most" in caplog.text
    engine.start_batching(parse_policy("uniform:6"), None, BatchConfig(max_model_len=128))
    with Server(engine) as server:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert block.name in health.json()["faults"][0]
        r = server.client().completions.create(model="m", prompt=PROMPTS[2], max_tokens=4)
        assert r.usage.completion_tokens == 4  # still served
    assert engine.store.served_width(7) == 4 and engine.store.served_width(8) == 6


def test_a_block_with_no_good_width_stops_the_server_taking_requests(bundled_pack, tmp_path):
    """Not verified at start (--no-verify): plane 0 of a block is bad, found when the first
    request needs it. That request gets a 503, a stream before its first token too (not an
    error event inside a 200); /health turns 503 "down" and later requests get 503."""
    pack_dir = tmp_path / "pack"
    shutil.copytree(bundled_pack, pack_dir)
    pack = Pack(pack_dir)
    for block in pack.blocks:  # every block: whichever expert the router picks
        _corrupt(pack_dir, block, 0)
    engine = Engine(pack)
    engine.start_batching(parse_policy("uniform:4"), None, BatchConfig(max_model_len=128))
    headers = {"Authorization": f"Bearer {KEY}"}
    with Server(engine, KEY) as server:
        url = server.url + "/v1/completions"
        for stream in (True, False, True):
            body = {"prompt": PROMPTS[3], "max_tokens": 4, "stream": stream}
            r = httpx.post(url, json=body, headers=headers, timeout=60)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "server_error"
            assert "checksum" in r.json()["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "down"
        assert pack.blocks[0].name.rsplit(".", 1)[0] in health.text


def test_an_engine_error_mid_stream_is_an_openai_error_event(served, monkeypatch):
    server, _, _ = served
    batcher = server.worker.batcher
    real, calls = batcher.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(batcher, "step", failing_step)
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": PROMPTS[5], "max_tokens": 20, "stream": True, "temperature": 0}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    monkeypatch.setattr(batcher, "step", real)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "boom" in error["message"]
    assert any(json.loads(e)["choices"][0]["text"] for e in events[:-2])  # tokens came first
    with pytest.raises(openai.APIError, match="boom"):
        calls.clear()
        monkeypatch.setattr(batcher, "step", failing_step)
        for _ in server.client().completions.create(model="m", prompt=PROMPTS[5], max_tokens=20,
                                                    stream=True):  # fmt: skip
            pass


def test_metrics_exposition_names_what_serves(bundled_pack):
    """/metrics' text (prometheus-client's): counters end in _total, each MoE layer's width and
    the serving policy, device and backend are labelled."""
    from pwctl.runtime.serve.server import prometheus

    engine = Engine(Pack(bundled_pack))
    batcher = engine.start_batching(parse_policy("uniform:4"), None, BatchConfig(max_seqs=1))
    text = prometheus(batcher.metrics())
    assert 'pwctl_serving_info{device="cpu",experts="store",policy="uniform:4"} 1.0' in text
    assert "pwctl_width_demotions_total 0.0" in text
    assert 'pwctl_layer_width_bits{layer="0"} 4.0' in text
