"""The OpenAI-compatible request bodies: parsed and checked field by field, so a bad request is
an HTTP 400 with an OpenAI-style error naming the field (`RequestError`), never a server error.

Chat prompts use the tokenizer's chat template when it has one; otherwise this fallback, one
line per message and an open assistant turn:

    system: You are terse.
    user: Hello
    assistant:
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pwctl.runtime.engine.scheduler import SEED_MAX, SEED_MIN, SamplingParams

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
ROLES = ("system", "user", "assistant", "developer", "tool")


class RequestError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message,
            param,
            code,
            status,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class Parsed:
    prompt: str | list[int]  # text, or token ids (completions only)
    params: SamplingParams
    max_tokens: int | None  # None: as many as the context allows
    stream: bool
    include_usage: bool


def _get(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:  # bool is an int in Python
        raise RequestError(f"'{name}' must be {_names(kinds)}, not a boolean", name)
    if not isinstance(value, kinds):
        raise RequestError(f"'{name}' must be {_names(kinds)}", name, "invalid_type")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    words = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}
    return " or ".join(words.get(k, k.__name__) for k in kinds)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = float(_get(body, name, (int, float), default))
    if not (math.isfinite(value) and lo <= value <= hi):
        raise RequestError(f"'{name}' must be between {lo:g} and {hi:g}", name, "invalid_value")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise RequestError(f"'stop' takes at most {MAX_STOP} strings", "stop", "invalid_value")
    return tuple(s for s in stops if s)


def _common(body: dict, prompt: str | list[int], max_name: str, default_max: int | None):
    if _get(body, "n", (int,), 1) != 1:
        raise RequestError("only n=1 is supported", "n", "invalid_value")
    max_tokens = _get(body, max_name, (int,), default_max)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"'{max_name}' must be at least 1", max_name, "invalid_value")
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    seed = _get(body, "seed", (int,), None)
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise RequestError("'seed' must fit in 64 bits", "seed", "invalid_value")
    params = SamplingParams(
        max_tokens=max_tokens or 1,  # resolved against the prompt's length by the server
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        stop=_stop(body),
        seed=seed,
        stream=stream,  # a whole response reads the text once, at the end
    )
    include_usage = bool(options.get("include_usage", False))
    return Parsed(prompt, params, max_tokens, stream, include_usage)


def parse_completion(body: Any) -> Parsed:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok_ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    )
    if not (isinstance(prompt, str) or ok_ids):
        raise RequestError(
            "'prompt' must be a string or a list of token ids (one prompt per request)",
            "prompt",
            "invalid_type",
        )
    if not prompt:
        raise RequestError("'prompt' is empty", "prompt", "invalid_value")
    if body.get("echo") or body.get("logprobs") or body.get("suffix"):
        raise RequestError("echo, logprobs and suffix are not supported", "echo", "unsupported")
    return _common(body, prompt, "max_tokens", 16)


def parse_chat(body: Any, tokenizer: Any) -> Parsed:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages", "invalid_type")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    return _common(body, chat_prompt(clean, tokenizer), name or "max_tokens", None)


def chat_prompt(messages: list[dict[str, str]], tokenizer: Any) -> str:
    """The tokenizer's chat template, or the fallback in this module's docstring."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    return "".join(lines) + "assistant:"


def _message(m: Any, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(f"{param} needs a role in {', '.join(ROLES)}", param, "invalid_value")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise RequestError(f"{param}: only text content is supported", param, "unsupported")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string", param, "invalid_type")
    return {"role": m["role"], "content": content}


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_json")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model", "invalid_type")
    return body
