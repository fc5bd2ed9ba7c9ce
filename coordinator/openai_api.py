"""OpenAI's request and response shapes, to and from the coordinator's one generation path.

Owns reading a `/v1/completions` or `/v1/chat/completions` body into plain values (the fields
OpenAI's clients send, vLLM's extra `top_k`, `min_p`, `repetition_penalty` and layerline's `speculate`), refusing what
layerline does not serve rather than ignoring it (`n` other than 1, a frequency or presence
penalty, `echo`, `best_of`, `logit_bias`, `suffix`, tools), and writing the answers and stream
chunks as OpenAI's clients parse them. The checks of values themselves are `Serving`'s, the same
as over gRPC; every refusal here names the field too.

Knows nothing of HTTP servers or of gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from layerline.shared.errors import InvalidInput
from layerline.shared.sampling import MAX_LOGPROBS, SamplingParams

from .generation import Delta, Finished

Json = dict[str, Any]
# Fields that would change the answer and that layerline does not serve, with the value that
# changes nothing: any other value is refused, never ignored.
UNSERVED = (
    ("echo", False),
    ("best_of", 1),
    ("suffix", None),
    ("logit_bias", None),
    ("tools", None),
    ("tool_choice", "none"),
    ("functions", None),
    ("function_call", "none"),
    ("ignore_eos", False),
    ("min_tokens", 0),
    ("stop_token_ids", None),
    ("include_stop_str_in_output", False),
)


@dataclass(frozen=True)
class Asked:
    """What an OpenAI body asks for, beyond the prompt or the messages."""

    sampling: SamplingParams
    max_tokens: int | None
    stop: list[str]
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool  # the answer carries logprobs (the sampled token's, and `sampling.logprobs` alternatives)
    speculate: int | None = None  # layerline's extra field: tokens drafted per step at most; None: the server's


def asked(body: Json, *, chat: bool) -> Asked:
    """The body's options, or InvalidInput naming the first field that is wrong or not served."""
    _refuse_unserved(body)
    if chat:
        max_tokens = _optional(body, "max_completion_tokens", int)
        if max_tokens is not None and max_tokens < 1:
            raise InvalidInput(f"max_completion_tokens = {max_tokens} must be >= 1")
        if max_tokens is None:
            max_tokens = _optional(body, "max_tokens", int)
        logprobs = bool(_optional(body, "logprobs", bool))
        top = _optional(body, "top_logprobs", int)
        if top is not None and not logprobs:
            raise InvalidInput("top_logprobs needs logprobs = true")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidInput(f"top_logprobs = {top} must be in [0, {MAX_LOGPROBS}]")
        alternatives = (top or 0) if logprobs else None
    else:
        max_tokens = _optional(body, "max_tokens", int)
        alternatives = _optional(body, "logprobs", int)
        logprobs = alternatives is not None
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidInput("stop must be a string or a list of strings")
    stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", dict) or {}
    if options and not stream:
        raise InvalidInput("stream_options needs stream = true")
    include_usage = _optional(options, "include_usage", bool)
    top_k = _optional(body, "top_k", int)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k in (None, -1) else top_k,  # vLLM's -1, like 0, keeps every token
        min_p=_number(body, "min_p", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        seed=_optional(body, "seed", int),
        logprobs=alternatives,
    )
    return Asked(
        sampling=sampling,
        max_tokens=max_tokens,
        stop=stop,
        model=_optional(body, "model", str) or "",
        stream=stream,
        include_usage=bool(include_usage),
        logprobs=logprobs,
        speculate=_optional(body, "speculate", int),
    )


def prompt_of(body: Json) -> str:
    """The one prompt of a completions body: a string, or a list holding one string."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (int, list)) for p in prompt):
        raise InvalidInput("prompt as token ids is not served; send the text")
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        raise InvalidInput(f"prompt: a list of {len(prompt)} prompts; one prompt per request is served")
    if not isinstance(prompt, str):
        raise InvalidInput("prompt must be a string")
    return prompt


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def messages_of(body: Json) -> list[ChatMessage]:
    """A chat body's messages; a content may be a string or a list of text parts."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidInput("messages must be a list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidInput(f"messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
                raise InvalidInput(f"messages[{i}].content: only text parts are served")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise InvalidInput(f"messages[{i}].content must be a string or a list of text parts")
        out.append(ChatMessage(m["role"], content))
    return out


def _refuse_unserved(body: Json) -> None:
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise InvalidInput("n must be an integer")
    if n not in (1, None):
        raise InvalidInput(f"n = {n}: only n = 1 is served (send the request again for another answer)")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (0, 0.0, None):
            raise InvalidInput(f"{name} = {body[name]} is not served; repetition_penalty (an extra field) is")
    for name, default in UNSERVED:
        if body.get(name) not in (default, None, {}, [], ""):
            raise InvalidInput(f"{name} is not served")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise InvalidInput("response_format is not served (only text)")


def _optional(body: Json, name: str, kind: type) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise InvalidInput(f"{name} must be {'an integer' if kind is int else f'a {kind.__name__}'}")
    return value


def _number(body: Json, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(f"{name} must be a number")
    return float(value)


class Answer:
    """One request's answer in OpenAI's shapes, as its events come."""

    def __init__(self, *, chat: bool, model: str, request_id: str, token_text: Any) -> None:
        self.chat = chat
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self.token_text = token_text  # token id -> its text, for logprobs
        self.text: list[str] = []
        self.logprobs: list[Json] = []
        self.finished: Finished | None = None
        self._streamed = 0  # characters of the answer streamed so far (the next chunk's text offset)
        self._chunks = 0  # chunks streamed so far

    def take(self, event: Delta | Finished, *, logprobs: bool) -> None:
        if isinstance(event, Finished):
            self.finished = event
            return
        self.text.append(event.text)
        if logprobs:
            self.logprobs += self._logprobs(event)

    def _logprobs(self, delta: Delta) -> list[Json]:
        out = []
        for token_id, (logprob, top) in zip(delta.token_ids, delta.logprobs):
            text = self.token_text(token_id)
            out.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": self.token_text(t), "logprob": lp, "bytes": list(self.token_text(t).encode())}
                        for t, lp in top
                    ],
                    "token_id": token_id,
                }
            )
        return out

    def _head(self, kind: str) -> Json:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> Json:
        f = self.finished
        assert f is not None
        return {
            "prompt_tokens": f.prompt_tokens,
            "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
        }

    def whole(self, *, logprobs: bool) -> Json:
        """The non-streamed answer."""
        assert self.finished is not None
        text = "".join(self.text)
        choice: Json = {"index": 0, "finish_reason": self.finished.reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = {"content": self.logprobs} if logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = _completion_logprobs(self.logprobs) if logprobs else None
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [choice],
            "usage": self.usage(),
        }

    def chunk(self, event: Delta | Finished, *, logprobs: bool) -> Json:
        """A streamed chunk for one event (the finish reason rides on the last one's; the first
        chat chunk carries the role)."""
        first, self._chunks = self._chunks == 0, self._chunks + 1
        text = event.text if isinstance(event, Delta) else ""
        reason = event.reason if isinstance(event, Finished) else None
        entries = self._logprobs(event) if logprobs and isinstance(event, Delta) else []
        choice: Json = {"index": 0, "finish_reason": reason}
        if self.chat:
            delta: Json = {"content": text} if text or not first else {}
            if first:
                delta = {"role": "assistant", "content": text}
            choice["delta"] = delta
            choice["logprobs"] = {"content": entries} if logprobs and entries else None
        else:
            choice["text"] = text
            choice["logprobs"] = _completion_logprobs(entries, self._streamed) if logprobs and entries else None
        self._streamed += len(text)
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [choice],
        }

    def usage_chunk(self) -> Json:
        """The last chunk of a stream with `include_usage`: no choices, the usage."""
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [],
            "usage": self.usage(),
        }


def _completion_logprobs(entries: list[Json], at: int = 0) -> Json:
    """The legacy completions shape: parallel lists; text offsets from `at` characters into the answer."""
    offsets = []
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def error_body(status: int, message: str, *, param: str | None = None) -> Json:
    """OpenAI's error shape for an HTTP status."""
    kinds = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }
    return {"error": {"message": message, "type": kinds.get(status, "server_error"), "param": param, "code": status}}
