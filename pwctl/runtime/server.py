"""`pwctl serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine thread.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream with SSE when asked),
GET /v1/models, /health, /metrics (Prometheus text). Every request must present
`Authorization: Bearer KEY` when the server has an API key. Bad requests get HTTP 400 with an
OpenAI-style error body; a full queue gets 429 (also one found full by the engine thread); a
request the engine fails gets 500, and any request while the engine is down 503. Any
model name is accepted (the server holds one model). Handlers only parse, tokenize and wait on
their request's update queue; the model runs in the engine thread (runtime/worker.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from pwctl.errors import PwctlError
from pwctl.runtime.protocol import Parsed, RequestError, parse_chat, parse_completion
from pwctl.runtime.scheduler import QueueFull
from pwctl.runtime.worker import EngineWorker, Update
from pwctl.runtime.worker import Request as Job


def create_app(worker: EngineWorker, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="pwctl", docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(worker, model_name)
    _install_errors(app)
    if api_key:
        _install_auth(app, api_key)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    app.get("/v1/models")(api.models)
    app.get("/health")(api.health)
    app.get("/metrics")(api.metrics)
    return app


def run_server(
    worker: EngineWorker, model_name: str, host: str, port: int, api_key: str | None
) -> None:
    """Serve until interrupted (the CLI's entry point)."""
    import uvicorn

    worker.start()
    try:
        uvicorn.run(create_app(worker, model_name, api_key), host=host, port=port)
    finally:
        worker.stop()


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


def _install_auth(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next: Callable) -> Any:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            e = RequestError("invalid or missing API key", None, "invalid_api_key", 401)
            return error_response(e)
        return await call_next(request)


class _Api:
    def __init__(self, worker: EngineWorker, model_name: str):
        self.worker, self.batcher, self.model_name = worker, worker.batcher, model_name
        self.created = int(time.time())

    # --- routes ---------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Any:
        parsed = parse_completion(await _json(request))
        return await self._run(request, parsed, _CompletionFormat(self.model_name))

    async def chat(self, request: Request) -> Any:
        body = await _json(request)
        parsed = self.batcher.locked(lambda: parse_chat(body, self.batcher.tokenizer))
        return await self._run(request, parsed, _ChatFormat(self.model_name))

    async def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created}
        return {"object": "list", "data": [card | {"owned_by": "pwctl"}]}

    async def health(self) -> JSONResponse:
        ok = self.worker.alive
        return JSONResponse({"status": "ok" if ok else "down"}, status_code=200 if ok else 503)

    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(prometheus(self.worker.metrics()))

    # --- a request through the engine -----------------------------------------------------------

    async def _run(self, request: Request, parsed: Parsed, fmt: _Format) -> Any:
        ids = self._tokens(parsed.prompt)
        params = self._params(parsed, len(ids))
        job = Job(ids, params, asyncio.get_running_loop())
        if not self.worker.alive:
            raise RequestError("the engine is not running", None, None, 503, "server_error")
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise RequestError(str(e), None, "rate_limit_exceeded", 429, "rate_limit_error") from e
        if parsed.stream:
            stream = _stream(self.worker, job, fmt, len(ids), parsed.include_usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        final = await _collect(self.worker, job, request)
        return fmt.full(final, len(ids))

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.batcher.encode(prompt)
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


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON body: {e}", None, "invalid_json") from e


async def _collect(worker: EngineWorker, job: Job, request: Request) -> Update:
    """Wait for the final update; a client that goes away gets its sequence aborted."""
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
            if update.result().finish_reason is not None:
                return update.result()
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _engine_error(update: Update) -> RequestError:
    if update.error.startswith("busy"):  # the queue was full after all: retry later, as at submit
        return RequestError(update.error, None, "rate_limit_exceeded", 429, "rate_limit_error")
    return RequestError(update.error, None, None, 500, "server_error")


async def _stream(
    worker: EngineWorker, job: Job, fmt: _Format, n_prompt: int, usage: bool
) -> AsyncIterator[str]:
    """SSE events: text deltas, the finish reason, [DONE]. Leaving early (the client closed
    the connection) aborts the sequence."""
    sent, done = 0, False
    try:
        yield _sse(fmt.chunk(None, "", start=True))
        while not done:
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
    """Prometheus text exposition of a Batcher.metrics() snapshot."""
    lines = []
    for kind, table, suffix in (("gauge", GAUGES, ""), ("counter", COUNTERS, "_total")):
        for name, doc in table.items():
            metric = f"pwctl_{name}{suffix}"
            lines += [f"# HELP {metric} {doc}", f"# TYPE {metric} {kind}", f"{metric} {m[name]}"]
    lines += ["# HELP pwctl_layer_width_bits mean expert width per MoE layer"]
    lines += ["# TYPE pwctl_layer_width_bits gauge"]
    for layer, bits in m["widths_per_layer"].items():
        lines.append(f'pwctl_layer_width_bits{{layer="{layer}"}} {bits:g}')
    return "\n".join(lines) + "\n"
