"""A checkpoint's text model: its tokenizer, special tokens, end-of-sequence ids and chat template.

This module owns reading the text half of a Hugging Face checkpoint directory (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`, `config.json`, `generation_config.json`),
turning text into token ids and back with the `tokenizers` library, and rendering a chat with the
checkpoint's Jinja template (compiled by `chat_template`). Its results equal what transformers'
`AutoTokenizer` gives for the same checkpoint (the tests hold it to that), without importing
transformers or torch. One difference, on purpose: the text of a special token inside a chat
message's content stays text (transformers would read it as the token, and let a user forge a
turn of the template's). Encoding releases the GIL, so it may run on a worker thread while an
event loop goes on.

It knows nothing of requests, sequences, streaming (`detokenizer` turns ids into text deltas) or
the network.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jinja2
from tokenizers import AddedToken, Encoding, Tokenizer

from layerline.shared.errors import OverLimit

from .chat_template import ChatTemplateError, compile_template

# The names transformers gives the special tokens; the chat template sees each one that is set.
SPECIAL_TOKEN_NAMES: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TextModelError(ValueError):
    """A checkpoint's tokenizer files are missing or malformed; the message names the file."""


@dataclass(frozen=True, eq=False)
class TextModel:
    """The text side of one checkpoint. Build it with `TextModel.from_checkpoint(directory)`."""

    tokenizer: Tokenizer  # from tokenizer.json, plus any named special token it lacked
    text_tokenizer: Tokenizer  # the same, reading the text of special tokens as plain text
    special_text: re.Pattern[str] | None  # finds the text of any special token; None if there is none
    special_tokens: Mapping[str, str]  # "bos_token" -> "<s>", ...: the chat template's variables
    special_token_ids: frozenset[int]  # ids that `decode` skips
    eos_token_ids: frozenset[int]  # config + generation_config + the tokenizer's eos token
    bos_token_id: int | None  # the tokenizer's bos token, else config.json's bos_token_id
    chat_template: jinja2.Template | None  # compiled in the sandbox; None if the checkpoint has none
    source: Path  # the checkpoint directory, for error messages

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike[str]) -> TextModel:
        """Load the tokenizer, special tokens, eos ids and chat template of a checkpoint directory."""
        root = Path(directory)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TextModelError(f"{tokenizer_file}: not found; a checkpoint needs a fast-tokenizer file")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tokenizer_config = _read_json(root / "tokenizer_config.json")
        model_config = _read_json(root / "config.json")
        generation_config = _read_json(root / "generation_config.json")

        special_tokens = {
            name: content
            for name in SPECIAL_TOKEN_NAMES
            if (content := _token_content(tokenizer_config.get(name), f"tokenizer_config.json: {name}"))
        }
        extra = tokenizer_config.get("additional_special_tokens") or tokenizer_config.get("extra_special_tokens") or []
        if isinstance(extra, dict):  # transformers 5 also names them: {"image_token": "<image>"}
            extra = list(extra.values())
        if not isinstance(extra, list):
            raise TextModelError(f"{root / 'tokenizer_config.json'}: additional_special_tokens must be a list")
        extra_contents = [_token_content(token, "tokenizer_config.json: additional_special_tokens") for token in extra]
        # As transformers does: a named special token that tokenizer.json lacks is added as special.
        missing = [
            content
            for content in [*special_tokens.values(), *extra_contents]
            if content and tokenizer.token_to_id(content) is None
        ]
        if missing:
            tokenizer.add_special_tokens(
                [AddedToken(c, special=True, normalized=False) for c in dict.fromkeys(missing)]
            )

        specials = {i: token.content for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        text_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        text_tokenizer.encode_special_tokens = True
        eos_ids = set(_token_ids(model_config.get("eos_token_id"), "config.json: eos_token_id"))
        eos_ids.update(_token_ids(generation_config.get("eos_token_id"), "generation_config.json: eos_token_id"))
        if "eos_token" in special_tokens:
            eos_ids.add(_required_id(tokenizer, special_tokens["eos_token"]))
        bos_token_id = (
            _required_id(tokenizer, special_tokens["bos_token"])
            if "bos_token" in special_tokens
            else next(iter(_token_ids(model_config.get("bos_token_id"), "config.json: bos_token_id")), None)
        )
        template_source = _chat_template_source(root, tokenizer_config)
        return cls(
            tokenizer=tokenizer,
            text_tokenizer=text_tokenizer,
            special_text=re.compile("|".join(map(re.escape, sorted(specials.values(), key=len, reverse=True))))
            if specials
            else None,
            special_tokens=special_tokens,
            special_token_ids=frozenset(specials),
            eos_token_ids=frozenset(eos_ids),
            bos_token_id=bos_token_id,
            chat_template=None if template_source is None else compile_template(template_source, root),
            source=root,
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the checkpoint's post-processor adds.

        Whether a BOS is prepended is decided by tokenizer.json's post-processor, exactly as
        transformers' fast tokenizer decides it (it ignores `add_bos_token` in tokenizer_config
        when a tokenizer.json exists; `layerline model import-gguf` writes the post-processor).
        """
        return _encode(self.tokenizer, text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens skipped.

        transformers' legacy `clean_up_tokenization_spaces` is never applied: transformers 5 skips
        it for BPE tokenizers, and it is lossy (" ." -> ".") in a way streaming could not follow.
        """
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The chat as the checkpoint's template writes it (as transformers' apply_chat_template)."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"the model at {self.source} has no chat template (neither chat_template.jinja nor "
                "tokenizer_config.json's chat_template); send a plain prompt instead of messages"
            )
        return self._render(_checked_messages(messages), add_generation_prompt=add_generation_prompt)

    def _render(self, chat: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        assert self.chat_template is not None, "render_chat checks that there is one"
        try:
            return self.chat_template.render(
                messages=chat,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"messages: the model's chat template rejected them: {err}") from err

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        max_bytes: int | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template wrote any BOS, so none is added again.

        The text of a special token inside a message's content stays text: `<|im_end|>` written
        by a user is the characters `<|im_end|>`, not the end of their turn. A chat whose contents
        hold no such text encodes exactly as transformers' apply_chat_template. A role must hold
        none, and a content that holds some must be written by the template as sent (ValueError
        naming the message otherwise). OverLimit if the rendering is more than `max_bytes` bytes
        of UTF-8.
        """
        chat = _checked_messages(messages)
        for i, message in enumerate(chat):
            found = self.special_text.search(message["role"]) if self.special_text else None
            if found:
                raise ValueError(f"messages[{i}].role: must not hold the special token {found.group()!r}")
        text = self.render_chat(chat, add_generation_prompt=add_generation_prompt)
        if max_bytes is not None and (size := len(text.encode())) > max_bytes:
            raise OverLimit(f"messages: the chat template renders them as {size} bytes; at most {max_bytes} may be")
        encoding = _encode(self.tokenizer, text, add_special_tokens=False)
        holding = [i for i, m in enumerate(chat) if self.special_text and self.special_text.search(m["content"])]
        if not holding:
            return encoding.ids
        spans = self._content_spans(chat, text, add_generation_prompt=add_generation_prompt, first=holding[0])
        return self._contents_as_text(text, encoding, spans)

    def _content_spans(
        self, chat: list[dict[str, str]], text: str, *, add_generation_prompt: bool, first: int
    ) -> list[tuple[int, int, int]]:
        """Where the template wrote each content in `text`: (start, end, message index) per copy.

        Found by rendering the chat again with a unique marker for each content: the spans are
        exact if putting the contents back in place of the markers gives `text` again. If it does
        not, the template changed a content or chose by it, and ValueError names message `first`.
        """
        nonce = uuid.uuid4().hex
        marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(chat)]
        rendered = self._render(marked, add_generation_prompt=add_generation_prompt)
        spans, pieces, at = [], [], 0
        for k, part in enumerate(re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)):  # text, index, ..., text
            piece = chat[int(part)]["content"] if k % 2 else part
            if k % 2:
                spans.append((at, at + len(piece), int(part)))
            pieces.append(piece)
            at += len(piece)
        if "".join(pieces) != text:
            raise ValueError(
                f"messages[{first}].content: holds the text of a special token, which the model's chat "
                "template does not write as sent; remove it"
            )
        return spans

    def _contents_as_text(self, text: str, encoding: Encoding, spans: list[tuple[int, int, int]]) -> list[int]:
        """`encoding` of `text`, but each run between two of the template's own special tokens that
        holds a special token inside a content is encoded again, reading special tokens as text.

        The run is encoded alone, as the tokenizer splits at special tokens anyway: with a
        byte-level tokenizer its ids are those of the same text in place. (A pre-tokenizer that
        marks the start of a text, as Metaspace's `prepend_scheme="first"`, marks the run's too.)
        """
        ids, offsets = encoding.ids, encoding.offsets
        bounds = [-1]  # indices of the template's special tokens, and one before the first token
        forged: set[int] = set()
        for k, token_id in enumerate(ids):
            if token_id not in self.special_token_ids:
                continue
            start, end = offsets[k]
            inside = [(a, b, i) for a, b, i in spans if a < end and start < b]
            if not inside:
                bounds.append(k)
            elif all(a <= start and end <= b for a, b, _ in inside):
                forged.add(len(bounds) - 1)  # in the run after the last bound
            else:
                raise ValueError(f"messages[{inside[0][2]}].content: a special token of the template runs into it")
        bounds.append(len(ids))
        out: list[int] = []
        for run, (left, right) in enumerate(itertools.pairwise(bounds)):
            if run in forged:
                start = offsets[left][1] if left >= 0 else 0
                stop = offsets[right][0] if right < len(ids) else len(text)
                out.extend(_encode(self.text_tokenizer, text[start:stop], add_special_tokens=False).ids)
            else:
                out.extend(ids[left + 1 : right])
            if right < len(ids):
                out.append(ids[right])
        return out


def _encode(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> Encoding:
    """`tokenizer.encode(text)`, through `encode_batch`: it releases the GIL (`encode` does not)."""
    (encoding,) = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
    return encoding


def _read_json(path: Path) -> dict[str, Any]:
    """The object in a JSON file, or {} if the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TextModelError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise TextModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: object, where: str) -> str | None:
    """A special token as tokenizer_config writes it: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TextModelError(f"{where}: expected a string or {{'content': ...}}, got {value!r}")


def _token_ids(value: object, where: str) -> list[int]:
    """An `eos_token_id`-style field: an int, a list of ints, or null."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if len(ids) != len(values):
        raise TextModelError(f"{where}: expected a token id or a list of token ids, got {value!r}")
    return ids


def _required_id(tokenizer: Tokenizer, content: str) -> int:
    token_id = tokenizer.token_to_id(content)
    assert token_id is not None, f"special token {content!r} was added to the tokenizer"
    return token_id


def _chat_template_source(root: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja first, else tokenizer_config's chat_template."""
    template_file = root / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TextModelError(f"{root / 'tokenizer_config.json'}: chat_template has no 'default' among {list(named)}")
    raise TextModelError(f"{root / 'tokenizer_config.json'}: chat_template must be a string or a list")


def _checked_messages(messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """Plain copies of the messages, after checking each field's type."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages: must be a list of {{'role', 'content'}} objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: must hold at least one message")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"messages[{i}]: must be an object with 'role' and 'content', got {type(message).__name__}"
            )
        for field in ("role", "content"):
            if field not in message:
                raise ValueError(f"messages[{i}].{field}: missing")
        for field, value in message.items():
            if not isinstance(field, str) or not isinstance(value, str):
                raise ValueError(f"messages[{i}].{field}: must be a string, got {type(value).__name__}")
        if not message["role"]:
            raise ValueError(f"messages[{i}].role: must not be empty")
        chat.append(dict(message))
    return chat
