"""`pwctl serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine thread.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream with SSE when asked),
GET /v1/models, /health, /metrics (Prometheus text). With an API key every route but /health
(and /metrics, unless metrics_auth) needs `Authorization: Bearer KEY` (the scheme in any case).
Bad requests get HTTP 400 with an OpenAI-style error body, a body over max_request_bytes 413
(refused before more of it is read); a full queue gets 429 (also one found full by the engine
thread); a request the engine fails gets 500, and any request while the engine is down 503. A
stream waits for its first token before it answers, so an engine failure before it is an error
status too; a failure later is an SSE event `data: {"error": {...}}` before `data: [DONE]`. Any
model name is accepted (the server holds one model).

The event loop only moves bytes: request bodies are decoded, checked and tokenized in a small
thread pool with tokenizers of its own (`Tokenizing`), and the model runs in the engine thread
(runtime/serve/worker.py), which also detokenizes.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException

from pwctl.errors import PwctlError
from pwctl.runtime.engine.scheduler import QueueFull
from pwctl.runtime.serve.protocol import Parsed, RequestError, parse_chat, parse_completion
from pwctl.runtime.serve.worker import EngineWorker, Update
from pwctl.runtime.serve.worker import Request as Job

T = TypeVar("T")
MAX_REQUEST_BYTES = 2_097_152  # 2 MiB, --max-request-bytes' default: ~500k tokens of text
TRIM_AFTER_BYTES = 256 * 2**10  # a body this large: hand the heap back once it is done
TOKENIZER_THREADS = 2  # one long prompt leaves a thread for the others


def create_app(
    worker: EngineWorker,
    model_name: str,
    api_key: str | None = None,
    *,
    metrics_auth: bool = False,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    load_tokenizer: Callable[[], Any] | None = None,
) -> FastAPI:
    """`load_tokenizer`: makes each request thread's tokenizer (default: the pack's, loaded
    again, so that thread never shares one with the engine thread)."""
    app = FastAPI(title="pwctl", docs_url=None, redoc_url=None, openapi_url=None)
    path = worker.engine.pack.path
    tokenizing = Tokenizing(load_tokenizer or (lambda: _pack_tokenizer(path)))
    api = _Api(worker, model_name, tokenizing, max_request_bytes)
    app.state.tokenizing = tokenizing
    _install_errors(app)
    if api_key:
        _install_auth(
            app, api_key, open_paths={"/health"} | (set() if metrics_auth else {"/metrics"})
        )
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    app.get("/v1/models")(api.models)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    return app


def _stops(worker: EngineWorker) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the engine thread stops when the app shuts down. uvicorn re-raises
    a SIGTERM it caught once the app is down, so run_server's `finally` may never run (and
    expert-parallel ranks must hear the stop before rank 0 goes)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        worker.stop()

    return lifespan


def run_server(
    worker: EngineWorker,
    model_name: str,
    host: str,
    port: int,
    api_key: str | None,
    **options: Any,
) -> None:
    """Serve until interrupted (the CLI's entry point); `options` go to create_app."""
    import uvicorn

    app = create_app(worker, model_name, api_key, **options)
    app.router.lifespan_context = _stops(worker)  # this app's engine thread, no other app's
    worker.start()
    try:
        uvicorn.run(app, host=host, port=port)
    finally:
        worker.stop()
        app.state.tokenizing.close()


class Tokenizing:
    """Where requests are decoded, checked and tokenized (chat templates applied): a few
    threads, each with a tokenizer of its own. Never the event loop (a 10 MB prompt held
    /health and every stream for 10 s there) and never the engine thread's tokenizer, whose
    lock its detokenization would wait on (stalling every stream)."""

    def __init__(self, load: Callable[[], Any], threads: int = TOKENIZER_THREADS):
        self._load, self._local = load, threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="pwctl-tokenize")

    async def run(self, fn: Callable[[Any], T]) -> T:
        """fn(this thread's tokenizer), in the pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(self._tokenizer()))

    def trim_soon(self, delay_s: float = 0.5) -> None:
        """Return freed heap to the system shortly (after the request's last references
        are gone): glibc keeps the pages a large prompt's tokenization used, so RSS grew by
        ~100x the body's size and stayed there."""
        loop = asyncio.get_running_loop()
        loop.call_later(delay_s, lambda: self._pool.submit(trim_heap))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tokenizer(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = self._load()
        return tok


def _pack_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def trim_heap() -> None:
    """malloc_trim(0) where the C library has it (glibc); elsewhere nothing."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(str(e.detail), None, None, e.status_code, kind))

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception) -> JSONResponse:
        return error_response(RequestError(f"internal error: {e}", None, None, 500, "server_error"))


def _install_auth(app: FastAPI, api_key: str, open_paths: set[str]) -> None:
    expected = api_key.encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next: Callable) -> Any:
        if request.url.path not in open_paths and not _authorized(request, expected):
            e = RequestError("invalid or missing API key", None, "invalid_api_key", 401)
            return error_response(e)
        return await call_next(request)


def _authorized(request: Request, expected: bytes) -> bool:
    """`Authorization: Bearer KEY`, the scheme matched in any case (RFC 9110, 11.1)."""
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected)


class _Api:
    def __init__(
        self, worker: EngineWorker, model_name: str, tokenizing: Tokenizing, max_bytes: int
    ):
        self.worker, self.batcher, self.model_name = worker, worker.batcher, model_name
        self.tokenizing, self.max_bytes = tokenizing, max_bytes
        self.created = int(time.time())

    # --- routes ---------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Any:
        return await self._request(request, self._completion, _CompletionFormat(self.model_name))

    async def chat(self, request: Request) -> Any:
        return await self._request(request, self._chat, _ChatFormat(self.model_name))

    async def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created}
        return {"object": "list", "data": [card | {"owned_by": "pwctl"}]}

    async def health(self) -> JSONResponse:
        status, body = self.worker.health()
        return JSONResponse(body, status_code=status)

    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(prometheus(self.worker.metrics()))

    # --- a request through the engine -----------------------------------------------------------

    async def _request(
        self, request: Request, prepare: Callable[[bytes, Any], Parsed], fmt: _Format
    ) -> Any:
        """Read the body (at most max_bytes), decode and tokenize it off the event loop, run it."""
        body = await _body(request, self.max_bytes)
        large = len(body) >= TRIM_AFTER_BYTES
        try:
            parsed, ids = await self.tokenizing.run(partial(self._prepared, prepare, body))
            del body  # a long stream need not keep it
            return await self._run(request, parsed, ids, fmt)
        finally:
            if large:  # once this request's memory is garbage (an error's frames included)
                self.tokenizing.trim_soon()

    @staticmethod
    def _completion(body: bytes, tokenizer: Any) -> Parsed:
        return parse_completion(_json(body))

    @staticmethod
    def _chat(body: bytes, tokenizer: Any) -> Parsed:
        return parse_chat(_json(body), tokenizer)

    def _prepared(
        self, prepare: Callable[[bytes, Any], Parsed], body: bytes, tokenizer: Any
    ) -> tuple[Parsed, list[int]]:
        """The request parsed and its prompt tokenized (in a tokenizing thread)."""
        parsed = prepare(body, tokenizer)
        return parsed, self._tokens(parsed.prompt, tokenizer)

    async def _run(self, request: Request, parsed: Parsed, ids: list[int], fmt: _Format) -> Any:
        params = self._params(parsed, len(ids))
        job = Job(ids, params, asyncio.get_running_loop())
        if not self.worker.serving:
            why = self.worker.failure or "the engine is not running"
            raise RequestError(why, None, None, 503, "server_error")
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise RequestError(str(e), None, "rate_limit_exceeded", 429, "rate_limit_error") from e
        if parsed.stream:
            first = await _collect(self.worker, job, request, final=False)  # errors: a status
            stream = _stream(self.worker, job, fmt, len(ids), parsed.include_usage, first)
            return StreamingResponse(stream, media_type="text/event-stream")
        final = await _collect(self.worker, job, request)
        return fmt.full(final, len(ids))

    def _tokens(self, prompt: str | list[int], tokenizer: Any) -> list[int]:
        if isinstance(prompt, str):
            return tokenizer(prompt).input_ids
        vocab = self.batcher.runner.model.config.vocab_size
        if max(prompt) >= vocab:
            raise RequestError(f"token ids must be below {vocab}", "prompt", "invalid_value")
        return list(prompt)

    def _params(self, parsed: Parsed, n_prompt: int) -> Any:
        b = self.batcher
        room = min(b.max_model_len, b.kv.pool.capacity * b.kv.block_size) - n_prompt
        max_tokens = parsed.max_tokens if parsed.max_tokens is not None else room
        if room < 1:
            raise RequestError(
                f"the prompt ({n_prompt} tokens) leaves no room in the context "
                f"({b.max_model_len} tokens)",
                "prompt",
                "context_length_exceeded",
            )
        params = dataclasses.replace(parsed.params, max_tokens=max_tokens)
        try:
            b.check(n_prompt, params)
        except PwctlError as e:
            raise RequestError(str(e), "max_tokens", "context_length_exceeded") from e
        return params


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes: at once when Content-Length says
    so, else as soon as the chunks read pass it (nothing more is read or kept)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> RequestError:
    return RequestError(
        f"the request body is larger than {limit} bytes (the server's --max-request-bytes)",
        None,
        "request_too_large",
        413,
    )


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON body: {e}", None, "invalid_json") from e


async def _collect(worker: EngineWorker, job: Job, request: Request, final: bool = True) -> Update:
    """Wait for the final update (or the first, with final=False); an engine error raises its
    RequestError; a client that goes away gets its sequence aborted."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            update = asyncio.ensure_future(job.updates.get())
            await asyncio.wait({update, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                update.cancel()
                worker.cancel(job)
                raise RequestError("client disconnected", None, None, 499)
            if update.result().error is not None:
                raise _engine_error(update.result())
            if not final or update.result().finish_reason is not None:
                return update.result()
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _engine_error(update: Update) -> RequestError:
    assert update.error is not None  # called for updates that carry one
    if update.error.startswith("busy"):  # the queue was full after all: retry later, as at submit
        return RequestError(update.error, None, "rate_limit_exceeded", 429, "rate_limit_error")
    return RequestError(update.error, None, None, update.status, "server_error")


async def _stream(
    worker: EngineWorker, job: Job, fmt: _Format, n_prompt: int, usage: bool, first: Update
) -> AsyncIterator[str]:
    """SSE events from the first update on: text deltas, the finish reason, [DONE]. An
    engine error after the first is an event {"error": {...}} (OpenAI's shape), then [DONE].
    Leaving early (the client closed the connection) aborts the sequence."""
    sent, done = 0, False
    update: Update | None = first
    try:
        yield _sse(fmt.chunk(None, "", start=True))
        while not done:
            if update is None:
                update = await job.updates.get()
            if update.error is not None:
                yield _sse(_engine_error(update).body())
                break
            done = update.finish_reason is not None
            text = update.text if done else _stable(update.text, job.params.stop)
            if len(text) > sent or done:
                yield _sse(fmt.chunk(update.finish_reason, text[sent:]))
                sent = max(sent, len(text))
            if done and usage:
                yield _sse(fmt.usage_chunk(_usage(n_prompt, update.tokens)))
            update = None
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            worker.cancel(job)


def _stable(text: str, stop: tuple[str, ...]) -> str:
    """The part of an unfinished output that can be sent: not a half-decoded character, and
    not the start of a stop string (a later token may complete it)."""
    text = text.rstrip("\ufffd")
    hold = max((len(s) - 1 for s in stop), default=0)
    return text[: len(text) - hold] if hold else text


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(n_prompt: int, n_out: int) -> dict[str, int]:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


class _Format:
    object_full = object_chunk = prefix = ""

    def __init__(self, model: str):
        self.model, self.created = model, int(time.time())
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"

    def envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, update: Update, n_prompt: int) -> dict[str, Any]:
        body = self.envelope(self.object_full, [self.choice(update.text, update.finish_reason)])
        return body | {"usage": _usage(n_prompt, update.tokens)}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return self.envelope(self.object_chunk, []) | {"usage": usage}

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, finish: str | None, delta: str, start: bool = False) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionFormat(_Format):
    object_full = object_chunk = "text_completion"
    prefix = "cmpl"

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk(self, finish: str | None, delta: str, start: bool = False) -> dict[str, Any]:
        return self.envelope(self.object_chunk, [self.choice(delta, finish)])


class _ChatFormat(_Format):
    object_full, object_chunk, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}

    def chunk(self, finish: str | None, delta: str, start: bool = False) -> dict[str, Any]:
        d = {"role": "assistant", "content": ""} if start else ({"content": delta} if delta else {})
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        return self.envelope(self.object_chunk, [choice])


GAUGES = {
    "memory_budget_bytes": "whole runtime budget: planes + KV + fixed",
    "fixed_bytes": "non-expert weights + activation workspace",
    "plane_bytes": "expert planes + tables at the current widths",
    "kv_block_bytes": "bytes of one KV block",
    "kv_blocks_used": "KV blocks held by sequences",
    "kv_blocks_limit": "KV blocks the budget allows now",
    "kv_blocks_capacity": "KV blocks the budget allows at most",
    "queue_length": "requests waiting for the scheduler",
    "running": "sequences running",
    "tokens_per_s": "generated tokens per second, recent",
}
COUNTERS = {
    "width_demotions": "blocks whose width was lowered for the KV cache",
    "width_demoted_bytes": "plane bytes freed by demotions",
    "width_promotions": "blocks whose width was raised when KV drained",
    "width_promoted_bytes": "plane bytes taken back by promotions",
    "preemptions": "sequences preempted (recomputed later)",
    "steps": "engine steps",
    "prompt_tokens": "prompt tokens prefilled (recomputation included)",
    "generated_tokens": "tokens generated",
    "finished": "requests finished",
    "aborted": "requests aborted (client gone)",
}


def prometheus(m: dict[str, Any]) -> str:
    """Prometheus text exposition of a Batcher.metrics() snapshot (prometheus-client's)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(m))
    return generate_latest(registry).decode()


class _Snapshot(Collector):
    """One snapshot's metric families: gauges, counters (exposed with `_total`), each MoE
    layer's mean width and what serves (policy, device, experts) as an info-style gauge."""

    def __init__(self, m: dict[str, Any]):
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(f"pwctl_{name}", doc, value=m[name])
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(f"pwctl_{name}", doc, value=m[name])
        if m.get("info"):
            labels = sorted(m["info"])
            info = GaugeMetricFamily(
                "pwctl_serving_info", "the policy, device and expert backend serving", labels=labels
            )
            info.add_metric([str(m["info"][k]) for k in labels], 1)
            yield info
        widths = GaugeMetricFamily(
            "pwctl_layer_width_bits", "mean expert width per MoE layer", labels=["layer"]
        )
        for layer, bits in m["widths_per_layer"].items():
            widths.add_metric([str(layer)], bits)
        yield widths
        yield from _rank_families(m.get("ranks") or [])


RANK_GAUGES = {
    "plane_bytes": "a rank's expert plane bytes",
    "kv_bytes": "a rank's KV bytes in use",
}
RANK_COUNTERS = {
    "width_moves": "a rank's width demotions + promotions",
    "generated_tokens": "tokens a rank generated for its requests",
    "exchange_calls": "a rank's MoE all-to-all exchanges",
    "exchange_sent_bytes": "bytes a rank sent in the all-to-alls",
    "exchange_seconds": "seconds a rank spent in the all-to-alls",
}


def _rank_families(ranks: list[dict[str, Any]]) -> Iterator[Metric]:
    """serve --expert-parallel: each rank's figures (rank_metrics), labelled by rank."""
    if not ranks:
        return
    flat = [{**r, **{f"exchange_{k}": v for k, v in r["exchange"].items()}} for r in ranks]
    for names, kind in ((RANK_GAUGES, GaugeMetricFamily), (RANK_COUNTERS, CounterMetricFamily)):
        for name, doc in names.items():
            family = kind(f"pwctl_rank_{name}", doc, labels=["rank"])
            for r in flat:
                family.add_metric([str(r["rank"])], r[name])
            yield family
    widths = GaugeMetricFamily(
        "pwctl_rank_layer_width_bits", "a rank's mean expert width per MoE layer",
        labels=["rank", "layer"],
    )  # fmt: skip
    for r in ranks:
        for layer, bits in r["widths_per_layer"].items():
            widths.add_metric([str(r["rank"]), str(layer)], bits)
    yield widths
