"""A model's chat template rendered as transformers' `apply_chat_template(tokenize=False)`
renders it, without importing transformers.

Templates come with downloaded files, so they are untrusted code: jinja2's immutable
sandbox, bounded in time and memory (engine/template_sandbox.py: every render runs under a
`RenderLimits`), transformers' globals and filters (`raise_exception`, `strftime_now`, a
`tojson` that does not HTML-escape, a `dict` and a `namespace` without their escape
hatches), its `{% generation %}` tag (rendered as its body), and the messages rebuilt out
of plain JSON types before a template sees them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from engine.template_bounds import DEFAULT_LIMITS, RenderLimits, RenderState, render_template
from engine.template_sandbox import BoundedSandbox

# A message's reasoning, under the names templates read it by (the first is the standard).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks;
    rendering it is rendering its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja's class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, without the type's own attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore names (no reach into CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:  # noqa: A002 - the templates' keyword
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """``source`` compiled (cached: a server compiles its models' templates once). Call it
    inside a `RenderState`: constants jinja folds while compiling are bounded too."""
    env = BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now,
                 "dict": _TemplateDict(), "namespace": _TemplateNamespace},
    )  # fmt: skip
    return env.from_string(source)


def plain(value: Any) -> Any:
    """``value`` rebuilt out of JSON types (anything else: a placeholder naming its type),
    so a template sees no object with methods the sandbox does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, bool, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value) if isinstance(value, tuple) \
            else [plain(v) for v in value]  # fmt: skip
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _message(message: Any) -> dict[str, Any]:
    message = plain(message)
    if not isinstance(message, dict):
        raise TypeError(f"chat messages should be dicts, not {message!r}")
    message = {k: v for k, v in message.items() if v is not None}  # content=None etc. dropped
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat(
    source: str,
    conversation: list[Any],
    special_tokens: Mapping[str, str],
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    add_generation_prompt: bool = False,
    limits: RenderLimits | None = None,
    **kwargs: Any,
) -> str:
    """``conversation`` through the template ``source``, within ``limits`` (None: the
    defaults); jinja's errors (a template that refuses the messages) are raised as they
    are, a bound as `TemplateBoundError`."""
    if not conversation:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools should be JSON schemas (dicts)")
    values = plain({**special_tokens, **kwargs})
    variables = dict(
        messages=[_message(m) for m in conversation], tools=plain(tools),
        documents=plain(documents), add_generation_prompt=add_generation_prompt, **values,
    )  # fmt: skip
    with RenderState(limits or DEFAULT_LIMITS) as state:
        template = compile_template(source)
        state.start_clock()  # a compile (once per template) is not the render's time
        return render_template(template, variables, state)
