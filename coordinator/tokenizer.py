"""A checkpoint's text model: its tokenizer, special tokens, end-of-sequence ids and chat template.

This module owns reading the text half of a Hugging Face checkpoint directory (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`, `config.json`, `generation_config.json`),
turning text into token ids and back with the `tokenizers` library, and rendering a chat with the
checkpoint's Jinja template in jinja2's immutable sandbox. Its results equal what transformers'
`AutoTokenizer` gives for the same checkpoint (the tests hold it to that), without importing
transformers or torch.

It knows nothing of requests, sequences, streaming (`detokenizer` turns ids into text deltas) or
the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

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


class ChatTemplateError(ValueError):
    """A chat cannot be rendered: the checkpoint has no chat template, or the template rejected it."""


@dataclass(frozen=True, eq=False)
class TextModel:
    """The text side of one checkpoint. Build it with `TextModel.from_checkpoint(directory)`."""

    tokenizer: Tokenizer  # from tokenizer.json, plus any named special token it lacked
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

        special_ids = frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)
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
            special_tokens=special_tokens,
            special_token_ids=special_ids,
            eos_token_ids=frozenset(eos_ids),
            bos_token_id=bos_token_id,
            chat_template=None if template_source is None else _compile(template_source, root),
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
        return self.tokenizer.encode(text, add_special_tokens=True).ids

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
        chat = _checked_messages(messages)
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

    def encode_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; the template wrote any BOS, so none is added again."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


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


# The template environment, as transformers builds it (utils/chat_template_utils.py), so that a
# template renders the same text: same whitespace control, filters, globals and extensions.


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: no HTML escaping, unicode kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing underscore-prefixed attributes (they reach interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self: jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


class _TemplateDict:
    """The `dict` global, without the attributes of the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendered as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads this class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _sandbox() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _compile(source: str, root: Path) -> jinja2.Template:
    try:
        return _sandbox().from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template of {root} does not parse: {err} (line {err.lineno})") from err
