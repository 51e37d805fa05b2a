"""The OpenAI API's requests and responses, mapped onto the pipeline's own request: what a field means here, which
fields are refused by name, and the JSON a client gets back. No HTTP here (specpipe.serving.server)."""
from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from specpipe.errors import InvalidRequest

# Fields of the OpenAI API this server takes (the chat and the completion endpoints' own, and the shared ones).
SHARED_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                           "stream_options", "user", "documents", "top_k"})
CHAT_FIELDS = SHARED_FIELDS | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = SHARED_FIELDS | {"prompt"}
# Fields the OpenAI API has that this server does not do; a request that sets one to anything but its neutral
# value is refused naming it, never silently served without it.
NEUTRAL_VALUES = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False,),
                  "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
                  "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (False,),
                  "response_format": ({"type": "text"},), "echo": (False,), "best_of": (1,), "suffix": ("",),
                  "service_tier": ("auto", "default"), "store": (False,), "metadata": ({},),
                  "modalities": (["text"],), "prediction": (), "audio": (), "reasoning_effort": (),
                  "web_search_options": ()}


class ApiError(Exception):
    """An error the server answers with its HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ApiRequest:
    """A chat or completion request in the pipeline's terms."""

    prompt: object  # chat messages (list of dicts) or a prompt string / token ids
    chat: bool
    max_new_tokens: int
    stop: tuple[str, ...]
    sampling: dict
    stream: bool
    include_usage: bool
    documents: list[str] | None = None
    extras: dict = field(default_factory=dict)


def parse_request(body: object, chat: bool, served_model: str, default_max_tokens: int) -> ApiRequest:
    """The pipeline's view of an OpenAI request body; ApiError (400, or 404 for another model) naming what is
    wrong. Values the pipeline checks itself (prompt text, token limits, sampling ranges) are left to it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    refused = sorted(key for key, value in body.items() if key in NEUTRAL_VALUES and value is not None
                     and value not in NEUTRAL_VALUES[key])
    if refused:
        raise ApiError(400, f"this server does not support {', '.join(refused)}: leave "
                            f"{'it' if len(refused) == 1 else 'them'} unset", param=refused[0])
    unknown = sorted(key for key in body if key not in known and key not in NEUTRAL_VALUES)
    if unknown:
        raise ApiError(400, f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; this endpoint takes "
                            f"{', '.join(sorted(known))}", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the name GET /v1/models lists", param="model")
    if model != served_model:
        raise ApiError(404, f"the model {model!r} is not served here; this server serves {served_model!r}",
                       kind="not_found_error", param="model", code="model_not_found")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise ApiError(400, f"n must be 1 (one answer per request), got {n!r}", param="n")
    key = "messages" if chat else "prompt"
    if key not in body:
        raise ApiError(400, f"{key} is required", param=key)
    prompt = body[key]
    if not chat:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if not isinstance(prompt, (str, list)):
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list of one of them", param=key)
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError(400, "stream_options takes include_usage only", param="stream_options")
    documents = body.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, str) for d in documents)):
        raise ApiError(400, "documents must be a list of strings", param="documents")
    sampling = {name: body[name] for name in ("temperature", "top_p", "seed", "top_k") if body.get(name) is not None}
    try:
        stop = stop_strings(body.get("stop"))
    except InvalidRequest as error:
        raise ApiError(400, str(error), param="stop") from None
    return ApiRequest(prompt, chat, max_tokens, stop, sampling, stream, bool(options.get("include_usage")),
                      documents)


def stop_strings(stop) -> tuple[str, ...]:
    """`stop` as the pipeline checks it: None, a string or a list of strings (InvalidRequest otherwise)."""
    from specpipe.pipelines.prompts import checked_stop

    return checked_stop(stop)


class StopTrimmer:
    """The text a client sees: OpenAI's stop strings end the answer and are not part of it. The pipeline keeps the
    stop string it stopped at (as transformers' generate does), so text that could be the start of a stop string
    is held back until the next chunk shows it is not."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(stop) for stop in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, chunk: str) -> str:
        self.text += chunk
        cut = self._cut()
        if cut is not None:
            return self._send(cut)
        return self._send(max(len(self.text) - self.hold, self.sent))

    def finish(self) -> str:
        cut = self._cut()
        return self._send(cut if cut is not None else len(self.text))

    @property
    def answer(self) -> str:
        cut = self._cut()
        return self.text if cut is None else self.text[:cut]

    def _cut(self) -> int | None:
        found = [self.text.find(stop) for stop in self.stops if stop in self.text]
        return min(found) if found else None

    def _send(self, end: int) -> str:
        chunk, self.sent = self.text[self.sent:end], max(self.sent, end)
        return chunk


def finish_reason(reason: str | None) -> str:
    """OpenAI's finish_reason for the pipeline's: an EOS or a stop string is "stop", the token budget "length"."""
    return "length" if reason == "length" else "stop"


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens whose rows the prefix cache gave."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def speculation_stats(stats, retrieved) -> dict:
    """The request's speculation and retrieval, as an extension field (SGLang's meta_info has the like)."""
    return {"steps": stats.steps, "mean_accepted_tokens": round(stats.mean_accepted, 4),
            "drafted_tokens_by_source": dict(sorted(stats.drafted_by_source.items())),
            "retrieved": [{"title": getattr(chunk, "title", ""), "score": float(getattr(chunk, "score", 0.0))}
                          for chunk in retrieved]}


def response(chat: bool, request_id: str, model: str, text: str, reason: str, prompt_tokens: int,
             completion_tokens: int, extension: dict, cached_tokens: int = 0) -> dict:
    choice = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
            "specpipe": extension}


def chunk(chat: bool, request_id: str, model: str, text: str | None, reason: str | None = None,
          first: bool = False) -> dict:
    choice = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(chat: bool, request_id: str, model: str, prompt_tokens: int, completion_tokens: int,
                extension: dict, cached_tokens: int = 0) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens), "specpipe": extension}


def invalid(error: InvalidRequest) -> ApiError:
    return ApiError(400, str(error))
