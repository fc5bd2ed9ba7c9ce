"""What a client's prompt or chat must pass before the coordinator works on it, and its tokenizing.

Owns `Admission` (the limits a request is held to), the checks made before anything else is done
with a prompt or a chat (its size in bytes, the number of messages, each role and content), and
`PromptEncoder`: prompts and chats to token ids on a small pool of threads, then the check of
their token count. `tokenizers` releases the GIL while it encodes, so a long prompt (about a
second per MB) never holds up the event loop, which also keeps heartbeats, probes and health.
Every refusal is an `InvalidInput` (an `OverLimit` for a bound) naming the field and the limit.

Knows nothing of gRPC (the servicer decodes messages and maps refusals to statuses), of sampling
or of the cluster.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from layerline.shared.errors import InvalidInput, OverLimit

from .settings import DEFAULT_MAX_CHAT_MESSAGES, DEFAULT_MAX_PROMPT_BYTES
from .text import TextModel

TOKENIZER_THREADS = 2  # prompts tokenized at once; one long prompt then never holds up all others
MAX_ROLE_BYTES = 64  # of a chat message's role ("system", "user", "assistant", "tool", ...)


@dataclass(frozen=True)
class Admission:
    max_active: int  # sequences generating at once, over all chains
    max_queued: int  # requests beyond max_active waiting (to be tokenized, for a slot); past it RESOURCE_EXHAUSTED
    rate_limit: float  # new requests admitted per second
    default_max_tokens: int  # when a request does not say
    max_context: int  # prompt plus generated tokens at most
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # UTF-8 bytes of a prompt, a chat's contents or rendering
    max_prompt_tokens: int | None = None  # a prompt's tokens at most; None: max_context
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES  # messages of one chat at most


class Message(Protocol):
    """A chat message as the wire gives it (the generated ChatMessage has these fields)."""

    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


def check_prompt(prompt: str, admission: Admission) -> None:
    """InvalidInput if the prompt is empty or more than max_prompt_bytes; it is not read further."""
    if not prompt:
        raise InvalidInput("prompt must not be empty")
    _utf8_size("prompt", prompt, admission.max_prompt_bytes, name="max_prompt_bytes = ")


def check_chat(messages: Sequence[Message], admission: Admission) -> list[dict[str, str]]:
    """The messages as the chat template takes them, once their number, roles and contents pass.

    At most max_chat_messages messages; each role 1 to MAX_ROLE_BYTES bytes; each content, and
    all of them together, at most max_prompt_bytes. Counted before any message is read.
    """
    if not messages:
        raise InvalidInput("messages must not be empty")
    if len(messages) > admission.max_chat_messages:
        raise OverLimit(f"messages: {len(messages)} messages; max_chat_messages = {admission.max_chat_messages}")
    limit, total = admission.max_prompt_bytes, 0
    for i, message in enumerate(messages):
        if not message.role:
            raise InvalidInput(f"messages[{i}].role must not be empty")
        _utf8_size(f"messages[{i}].role", message.role, MAX_ROLE_BYTES)
        total += _utf8_size(f"messages[{i}].content", message.content, limit, name="max_prompt_bytes = ")
        if total > limit:
            raise OverLimit(f"messages: their contents together are longer than max_prompt_bytes = {limit} bytes")
    return [{"role": m.role, "content": m.content} for m in messages]


def _utf8_size(field: str, text: str, limit: int, *, name: str = "") -> int:
    """The UTF-8 size of `text`, or OverLimit naming `field` and the limit (`name` + `limit`) past
    it. A text of more than `limit` characters is refused without being measured."""
    try:
        size = len(text) if len(text) > limit else len(text.encode())
    except UnicodeEncodeError:
        raise InvalidInput(f"{field} is not valid Unicode text (it holds a lone surrogate)") from None
    if size > limit:
        raise OverLimit(f"{field} is longer than {name}{limit} bytes")
    return size


class PromptEncoder:
    """Prompts and chats to token ids on `TOKENIZER_THREADS` threads; the count checked after."""

    def __init__(self, text: TextModel, admission: Admission) -> None:
        self.text = text
        self.max_prompt_bytes = admission.max_prompt_bytes
        self.max_prompt_tokens = admission.max_prompt_tokens or admission.max_context
        self._threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="layerline-tokenize")

    async def prompt(self, prompt: str) -> list[int]:
        """The prompt's ids (the tokenizer's own special tokens added, as `TextModel.encode`)."""
        return self._counted("prompt", await self._off_loop(functools.partial(self.text.encode, prompt)))

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of the chat as its template renders it; InvalidInput for what the template refuses."""
        encode = functools.partial(self.text.encode_chat, messages, max_bytes=self.max_prompt_bytes)
        try:
            ids = await self._off_loop(encode)
        except OverLimit as err:
            raise OverLimit(f"{err} (max_prompt_bytes)") from None
        except InvalidInput:
            raise
        except ValueError as err:  # the chat template's refusals, and special tokens where none may be
            raise InvalidInput(str(err)) from err
        return self._counted("messages", ids)

    async def _off_loop(self, encode: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._threads, encode)

    def _counted(self, field: str, ids: list[int]) -> list[int]:
        if len(ids) > self.max_prompt_tokens:
            raise OverLimit(f"{field} is {len(ids)} tokens; max_prompt_tokens = {self.max_prompt_tokens}")
        return ids

    def close(self) -> None:
        """Let the threads end once what they run is done; what waits for one is dropped."""
        self._threads.shutdown(wait=False, cancel_futures=True)
