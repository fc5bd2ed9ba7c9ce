"""A checkpoint's chat template, compiled as transformers compiles it, in jinja2's immutable sandbox.

Owns the template environment (its whitespace control, filters, globals and extensions, as
transformers' utils/chat_template_utils.py builds them, so that a template renders the same
text) and the refusal of what would reach interpreter internals. Knows nothing of tokenizers,
messages' limits or requests: `tokenizer.TextModel` renders chats with what this compiles.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat cannot be rendered: the checkpoint has no chat template, or the template rejected it."""


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


def compile_template(source: str, root: Path) -> jinja2.Template:
    """The chat template `source` of the checkpoint at `root`, compiled in the sandbox."""
    try:
        return _sandbox().from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template of {root} does not parse: {err} (line {err.lineno})") from err
