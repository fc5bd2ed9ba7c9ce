"""The coordinator's text pipeline in one import: text to token ids and back, chats, stop strings.

The pieces live by role: `tokenizer` (the checkpoint's tokenizer, eos ids and chats),
`chat_template` (the chat template's sandboxed environment) and `detokenizer` (streamed ids to
text deltas, stop strings). Nothing here imports torch or transformers.
"""

from __future__ import annotations

from .chat_template import ChatTemplateError
from .detokenizer import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, IncrementalDetokenizer, StopMatcher
from .tokenizer import TextModel, TextModelError

__all__ = [
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopMatcher",
    "TextModel",
    "TextModelError",
]
