"""The OpenAI API's shapes: requests read and checked into plain dataclasses, responses and stream
chunks built from them. Pure: no I/O, nothing of the ranks.

Fields follow the OpenAI reference; where it is silent, mlx_lm.server's and llama.cpp's names
(`ignore_eos`, `timings`). Extensions ride in `usage`: `prompt_tokens_details.cached_tokens` (the
OpenAI field: the prompt tokens the ranks already held), `ttft_ms`, `algorithm` and `cache` (where
the held tokens came from: "memory", "disk" or "none").
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

MAX_STOPS = 4  # as OpenAI
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' logprobs, as OpenAI


class ApiError(Exception):
    """An error answered as OpenAI answers them: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class GenerationParams:
    """What a request asks of the generation, whichever endpoint it came to."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs, this many most likely tokens too
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_progress: bool = False  # a stream also says how far the prompt's prefill got (llama.cpp's)


@dataclass
class ChatRequest:
    messages: list[dict[str, str]]  # role and text content, for the chat template
    params: GenerationParams


@dataclass
class CompletionRequest:
    prompt: str | list[int]  # text, or token ids as they are
    params: GenerationParams


# The fields each endpoint takes; any other is refused by name, as OpenAI does.
SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                   "n", "user", "presence_penalty", "frequency_penalty", "ignore_eos", "logprobs",
                   "return_progress"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo"}
ROLES = ("system", "developer", "user", "assistant")


def parse_chat(body: object, model: str, defaults: GenerationParams) -> ChatRequest:
    data = _fields(body, CHAT_FIELDS, model)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array of {role, content}", param="messages")
    chat = [_message(m, i) for i, m in enumerate(messages)]
    if chat[-1]["role"] == "assistant":
        raise ApiError(400, "the last message is the assistant's: nothing to answer", param="messages")
    logprobs = data.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise ApiError(400, "logprobs must be true or false", param="logprobs")
    top = data.get("top_logprobs") or 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS}",
                       param="top_logprobs")
    if top and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if "max_completion_tokens" in data:
        data["max_tokens"] = data["max_completion_tokens"]
    return ChatRequest(chat, _params(data, defaults, logprobs, top))


def parse_completion(body: object, model: str, defaults: GenerationParams) -> CompletionRequest:
    data = _fields(body, COMPLETION_FIELDS, model)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and not (prompt and all(isinstance(t, int) and t >= 0 for t in prompt)):
        raise ApiError(400, "prompt must be a string or an array of token ids (one prompt)", param="prompt")
    if not isinstance(prompt, str | list) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string or array of token ids", param="prompt")
    if data.get("echo"):
        raise ApiError(400, "echo is not supported", param="echo")
    logprobs = data.get("logprobs")  # the legacy API's: how many alternatives (0: the chosen token's only)
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
        raise ApiError(400, f"logprobs must be a whole number from 0 to {MAX_COMPLETION_LOGPROBS}",
                       param="logprobs")
    return CompletionRequest(prompt, _params(data, defaults, logprobs is not None, logprobs or 0))


def _fields(body: object, allowed: set[str], model: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    if "model" in body and body["model"] not in (model, None):
        raise ApiError(404, f"The model {body['model']!r} does not exist: this server runs {model!r}",
                       param="model", code="model_not_found")
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: one answer a request", param="n")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if body.get(penalty, 0) != 0:
            raise ApiError(400, f"{penalty} is not supported (only 0)", param=penalty)
    return dict(body)


def _message(message: object, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ApiError(400, f"{param} needs a role of {', '.join(ROLES)}", param=param)
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"{param}: only text content parts are supported", param=param)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{param}.content must be a string or text parts", param=param)
    role = "system" if message["role"] == "developer" else message["role"]
    return {"role": role, "content": content}


def _params(data: dict, defaults: GenerationParams, logprobs: bool, top: int) -> GenerationParams:
    def number(name: str, kind: type, low: float, high: float, default):
        value = data.get(name)
        if value is None:
            return default
        whole = kind is float or (isinstance(value, int | float) and value == int(value))
        if isinstance(value, bool) or not isinstance(value, int | float) or not whole:
            what = "number" if kind is float else "whole number"
            raise ApiError(400, f"{name} must be a {what}", param=name)
        if not low <= value <= high:
            raise ApiError(400, f"{name} must be between {low:g} and {high:g}, got {value}", param=name)
        return kind(value)

    stop = data.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be a string or up to {MAX_STOPS} non-empty strings", param="stop")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options takes include_usage only", param="stream_options")
    return GenerationParams(
        max_tokens=number("max_tokens", int, 1, 1 << 31, defaults.max_tokens),
        temperature=number("temperature", float, 0, 2, defaults.temperature),
        top_p=number("top_p", float, 0, 1, defaults.top_p),
        seed=number("seed", int, -(1 << 63), (1 << 63) - 1, defaults.seed),
        stop=stop, logprobs=logprobs, top_logprobs=top, ignore_eos=bool(data.get("ignore_eos", False)),
        stream=bool(data.get("stream", False)), include_usage=bool(options.get("include_usage", False)),
        return_progress=bool(data.get("return_progress", False)),
    )


# ---- responses


@dataclass
class Outcome:
    """How a generation went, for the response's usage and finish reason."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    algorithm: str = ""
    cache: str = "none"  # where the kept prompt tokens came from: "memory" | "disk" | "none"
    finish_reason: str = "stop"  # "stop" (the model ended, or a stop string) | "length"

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "ttft_ms": self.ttft_ms, "algorithm": self.algorithm, "cache": self.cache}

    def timings(self) -> dict:
        """llama.cpp's timings block."""
        return {"cache_n": self.cached_tokens, "prompt_n": self.prompt_tokens - self.cached_tokens,
                "prompt_ms": self.ttft_ms, "predicted_n": self.completion_tokens,
                "predicted_per_second": self.decode_tokens_per_s}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class TokenLogprob:
    """A generated token's text and log-probability, and the most likely tokens' when asked."""

    text: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(t.text, t.logprob) | {"top_logprobs": [entry(*x) for x in t.top]}
                        for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprob], offset: int = 0) -> dict:
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    top = [dict(t.top) for t in tokens] if any(t.top for t in tokens) else None
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": top, "text_offset": offsets}


def chat_response(rid: str, model: str, text: str, outcome: Outcome, logprobs: list | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                         "finish_reason": outcome.finish_reason}],
            "usage": outcome.usage(), "timings": outcome.timings()}


def completion_response(rid: str, model: str, text: str, outcome: Outcome, logprobs: list | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text,
                         "logprobs": completion_logprobs(logprobs) if logprobs is not None else None,
                         "finish_reason": outcome.finish_reason}],
            "usage": outcome.usage(), "timings": outcome.timings()}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, logprobs: list | None = None,
               usage: dict | None = None) -> dict:
    choices = [{"index": 0, "delta": delta, "finish_reason": finish,
                "logprobs": chat_logprobs(logprobs) if logprobs is not None else None}]
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
             "choices": choices if usage is None else []}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def prompt_progress(total: int, cached: int, computed: int, ms: float) -> dict:
    """llama.cpp's `prompt_progress`: of the prompt's `total` tokens, `cache` were held already and
    `processed` are done (those included), `time_ms` since the request began."""
    return {"prompt_progress": {"total": total, "cache": cached, "processed": cached + computed,
                                "time_ms": round(ms, 1)}}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, logprobs: list | None = None,
                     usage: dict | None = None, offset: int = 0) -> dict:
    choices = [{"index": 0, "text": text, "finish_reason": finish,
                "logprobs": completion_logprobs(logprobs, offset) if logprobs is not None else None}]
    chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
             "choices": choices if usage is None else []}
    if usage is not None:
        chunk["usage"] = usage
    return chunk
