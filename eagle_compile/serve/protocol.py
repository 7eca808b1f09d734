"""The OpenAI wire format: request validation and response shapes for /v1/completions and /v1/chat/completions.

Every request is validated here before it reaches the engine; a bad one becomes `RequestError`, which the app
answers in OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`, status 4xx), so the official
`openai` client raises its usual `BadRequestError` / `NotFoundError`. A field we cannot honour (n > 1, logprobs,
penalties, tools, ...) is refused naming the field, never silently dropped: the output would not be what the
client asked for.

Sampling follows OpenAI's defaults (temperature 1, top_p 1); `temperature=0` is greedy decoding, which is exactly
`eagle_compile.generate`'s greedy output. `top_k` and `stop_token_ids` are vLLM's extra fields (the client passes
them with `extra_body=`).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from eagle_compile.runtime.sampling import SamplingParams

DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}      # OpenAI's legacy completions default is 16
MAX_STOP_STRINGS = 4
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
           "stop_token_ids", "seed", "user"}
_FIELDS = {"completion": _COMMON | {"prompt"}, "chat": _COMMON | {"messages", "max_completion_tokens"}}
# fields of OpenAI's API that change the output in ways we do not implement: refused when set to a non-default
_UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
                "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
                "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,)}
_ROLES = ("system", "user", "assistant")


class RequestError(Exception):
    """A request the server refuses; `status` is its HTTP status, the rest OpenAI's error fields."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict:
        return error_body(self.message, kind=self.kind, param=self.param, code=self.code)


def error_body(message: str, *, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request: `prompt` (completions) or `messages` (chat; the template is applied by the app)."""

    kind: str                                  # "completion" or "chat"
    model: str
    max_tokens: int
    sampling: SamplingParams
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def parse_request(kind: str, raw: bytes, served_model: str) -> GenerationRequest:
    """Validate the JSON body of a completions (`kind="completion"`) or chat completions (`"chat"`) request."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON ({error}); send a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_unsupported(body, kind)
    model = _required(body, "model", str)
    if model != served_model:
        raise RequestError(f"the model {model!r} does not exist; this server serves {served_model!r} "
                           "(GET /v1/models)", param="model", status=404, code="model_not_found")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise RequestError(f"n={n!r} is not supported: one choice per request; send n requests instead",
                           param="n")
    max_tokens = _max_tokens(body, kind)
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
    include_usage = bool(_typed(options or {}, "include_usage", bool, False, param="stream_options.include_usage"))
    common = dict(kind=kind, model=model, max_tokens=max_tokens, sampling=_sampling(body),
                  seed=_integer(body, "seed", None), stop=_stop(body), stop_token_ids=_stop_ids(body),
                  stream=stream, include_usage=include_usage)
    if kind == "completion":
        return GenerationRequest(prompt=_prompt(body), **common)
    return GenerationRequest(messages=_messages(body), **common)


# -- fields ----------------------------------------------------------------------------------------------------
def _refuse_unsupported(body: dict, kind: str) -> None:
    for name, defaults in _UNSUPPORTED.items():
        if name in body and body[name] not in defaults:
            raise RequestError(f"{name}={body[name]!r} is not supported by this server (EAGLE 3.1 speculative "
                               "decoding returns the target's tokens only); remove the field", param=name)
    unknown = sorted(set(body) - _FIELDS[kind] - set(_UNSUPPORTED))
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; supported: {sorted(_FIELDS[kind])}", param=unknown[0])


def _required(body: dict, name: str, kind: type) -> Any:
    if name not in body:
        raise RequestError(f"the field {name!r} is required", param=name)
    return _typed(body, name, kind, None)


def _typed(body: dict, name: str, kind: type, default: Any, param: str | None = None) -> Any:
    value = body.get(name, default)
    if value is None or value is default:
        return default
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise RequestError(f"{name} must be a {kind.__name__}, got {type(value).__name__} {value!r}",
                           param=param or name)
    return value


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {type(value).__name__} {value!r}", param=name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a number, got {type(value).__name__} {value!r}", param=name)
    if not low <= value <= high:
        raise RequestError(f"{name}={value} is out of range [{low}, {high}]", param=name)
    return float(value)


def _max_tokens(body: dict, kind: str) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _integer(body, name, DEFAULT_MAX_TOKENS[kind])
    if value < 1:
        raise RequestError(f"{name}={value} must be at least 1", param=name)
    return value


def _sampling(body: dict) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = _integer(body, "top_k", 0)
    if top_k < -1:
        raise RequestError(f"top_k={top_k} must be >= 0 (0 or -1: no top-k filter)", param="top_k")
    if temperature == 0.0:
        return SamplingParams(do_sample=False)
    if top_p == 0.0:
        raise RequestError("top_p=0 keeps no token; use temperature=0 for greedy decoding", param="top_p")
    return SamplingParams(do_sample=True, temperature=temperature, top_k=max(top_k, 0), top_p=top_p)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {stop!r}", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    return tuple(stops)


def _stop_ids(body: dict) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RequestError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}", param="stop_token_ids")
    return tuple(ids)


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError(f"prompt must be a string (one prompt per request), got {type(prompt).__name__}"
                           f" {prompt!r:.80}", param="prompt")
    if not prompt:
        raise RequestError("prompt is empty; give at least one character", param="prompt")
    return prompt


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {messages!r:.80}",
                           param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise RequestError(f"messages[{i}] must be an object with role one of {list(_ROLES)}, got {m!r:.80}",
                               param=f"messages[{i}].role")
        out.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return tuple(out)


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got {content!r:.80}",
                       param=f"messages[{i}].content")


# -- responses -------------------------------------------------------------------------------------------------
def response(request: GenerationRequest, text: str, finish_reason: str, usage: dict) -> dict:
    """The whole (non-streamed) response."""
    if request.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    return {"id": request.id, "object": obj, "created": request.created, "model": request.model,
            "choices": [choice], "usage": usage}


def chunk(request: GenerationRequest, text: str | None, finish_reason: str | None = None, *,
          first: bool = False, usage: dict | None = None) -> dict:
    """One streamed chunk; `text=None` with `usage`: the final usage-only chunk (stream_options.include_usage)."""
    if text is None:
        choices = []
    elif request.kind == "completion":
        choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    else:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choices = [{"index": 0, "delta": delta if text or first else {}, "logprobs": None,
                    "finish_reason": finish_reason}]
    obj = "text_completion" if request.kind == "completion" else "chat.completion.chunk"
    out = {"id": request.id, "object": obj, "created": request.created, "model": request.model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out
