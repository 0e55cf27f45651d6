"""jinja2's filters and globals under a render's bounds (engine/template_bounds.py).

Every filter is wrapped: the deadline is checked when it is called and what it returns is
counted against the value and memory bounds. A filter whose output can outgrow its input
many times over (a width, a count or a separator argument) first has that output's size
predicted from its arguments, and is refused before it allocates: `center(10**10)` never
runs. `sum` is replaced by a linear sum (jinja's adds lists one at a time: quadratic), and
`pprint` and `lipsum` are left out (their output has no cheap bound; no chat template uses
them). `range` is bounded, and every `{% for %}` iterates through `LOOP_GUARD`, which checks
the deadline when the loop starts and, past `UNGUARDED_LOOP` items, at each turn
(engine/template_sandbox.py rewrites loops to use it).
"""

from __future__ import annotations

import itertools
import json
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from jinja2 import pass_context, pass_environment
from jinja2.filters import make_attrgetter
from markupsafe import Markup

from engine.template_bounds import RenderState, current, join_bounded, text_size

LOOP_GUARD = "_bounded_loop"
LEFT_OUT = ("pprint",)  # filters, beside the global `lipsum`

# (state, context, value, args, kwargs) -> (value, args, kwargs), refusing an output that
# would pass the value bound; args and kwargs are the filter's own after its value.
Predictor = Callable[[RenderState, Any, Any, tuple, dict], tuple[Any, tuple, dict]]


def bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (jinja filter ``name``) under the render's bounds. The wrapper takes the
    context, which also keeps jinja from calling it while compiling (a constant folded
    there would escape the render's bounds)."""
    predict = PREDICTORS.get(name)
    pass_arg = getattr(function, "jinja_pass_arg", None)
    passes = pass_arg.name if pass_arg is not None else None

    @pass_context
    def bounded(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        state = current()
        state.check_time()
        if predict is not None:
            value, args, kwargs = predict(state, context, value, args, kwargs)
        if passes is None:
            result = function(value, *args, **kwargs)
        elif passes == "context":
            result = function(context, value, *args, **kwargs)
        elif passes == "eval_context":
            result = function(context.eval_ctx, value, *args, **kwargs)
        else:
            result = function(context.environment, value, *args, **kwargs)
        return state.produced(result)

    bounded.__name__ = bounded.__qualname__ = f"bounded_{name}"
    return bounded


class _Guarded:
    """An iterable whose iteration checks the render's deadline each turn (and which keeps
    its length, so `loop.length` does not materialise it)."""

    __slots__ = ("_iterable",)

    def __init__(self, iterable: Any) -> None:
        self._iterable = iterable

    def __len__(self) -> int:
        return len(self._iterable)

    def __iter__(self) -> Iterator[Any]:
        state = current()
        clock = time.monotonic
        for item in self._iterable:
            if clock() > state.next_check:
                state.check_time()
            yield item


# A loop over at most this many items is not guarded item by item: its turns run what its
# body holds, and each loop or call in there checks the deadline itself.
UNGUARDED_LOOP = 64


@pass_context
def loop_guard(context: Any, iterable: Any) -> Any:
    """A `{% for %}`'s iterable: the deadline checked now and, for a long (or unsized)
    one, at every turn."""
    current().check_time()
    try:
        if len(iterable) <= UNGUARDED_LOOP:
            return iterable
    except TypeError:  # a generator: no length
        pass
    return _Guarded(iterable)


def bounded_range(*args: int) -> range:
    """`range`, no longer than the value bound (jinja's own sandbox: 100,000 whatever the
    context)."""
    numbers = range(*args)
    current().check_length(len(numbers), "a range")
    return numbers


@pass_environment
def linear_sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """jinja's `sum` in linear time: it adds lists (tuples) one by one, copying the sum so
    far each time (40,000 one-item lists: 1.5 s, and quadratic: 600,000 would take minutes,
    in C, where no deadline is checked); here they are chained once."""
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    if not isinstance(start, (list, tuple)):
        return sum(iterable, start)
    state = current()
    items = bounded_list(state, iterable)
    kind = type(start)
    for item in items:
        if type(item) is not kind:
            raise TypeError(f'can only concatenate {kind.__name__} (not "{type(item).__name__}")'
                            f" to {kind.__name__}")  # fmt: skip
    state.check_length(len(start) + sum(map(len, items)), "a collection")
    return kind(itertools.chain(start, *items))


def bounded_list(state: RenderState, iterable: Iterable[Any]) -> list[Any]:
    """``iterable`` as a list, refused once it holds more items than the value bound."""
    if isinstance(iterable, list):
        return iterable
    items = []
    for item in iterable:
        items.append(item)
        if len(items) > state.max_value:
            state.refuse("a collection", len(items))
    return items


def bounded_tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:  # fmt: skip
    """transformers' `tojson` (no HTML escaping, `json.dumps`' arguments), refused past the
    value bound: compact JSON is measured before the C encoder builds it (`[s] * n` is n
    copies of s); anything else streams from the Python encoder, counted."""
    state = current()
    if isinstance(indent, int):  # the encoder makes `" " * indent` before any output
        state.check_length(indent, "a string")
    if indent is None and separators is None and not ensure_ascii:
        state.check_length(text_size(x, state.max_value, as_json=True), "a string")
        return json.dumps(x, ensure_ascii=False, sort_keys=sort_keys)
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)  # fmt: skip
    return join_bounded(encoder.iterencode(x), state)


def as_text(state: RenderState, value: Any) -> str:
    """``str(value)``, refused before it is built when it would pass the value bound."""
    if isinstance(value, str):
        return value
    state.check_length(text_size(value, state.max_value), "a string")
    return str(value)


# -- the size of what a format makes ---------------------------------------------------------

_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def _number(digits: str) -> int:
    return int(digits) if len(digits) <= 18 else 10**18  # past 18 digits: past any bound


def escaping(text: Any) -> int:
    """How many times over a value grows when ``text``'s methods put it in: a `Markup`
    (`escape`, `safe`) escapes what it takes, `<` to `&lt;`, at most 6 characters for 1."""
    return 6 if isinstance(text, Markup) else 1


def _largest_text(state: RenderState, values: list[Any], conversions: str, into: Any) -> int:
    """The longest any of ``values`` can be in the output: quoted, as repr shows it,
    escaped ten times over for `ascii()`'s conversion, and escaped into a `Markup`."""
    factor = (10 if "a" in conversions else 1) * escaping(into)
    return max((factor * text_size([v], state.max_value) for v in values), default=0)


def printf_size(state: RenderState, template: Any, values: Any) -> int:
    """An upper bound of ``len(template % values)``; 0 if ``template`` is not text."""
    if not isinstance(template, (str, bytes)):
        return 0
    text = template if isinstance(template, str) else template.decode("latin-1")
    specs = _PRINTF.findall(text)
    items = list(values.values()) if isinstance(values, Mapping) else \
        list(values) if isinstance(values, tuple) else [values]  # fmt: skip
    numbers = [_number(d) for spec in specs for d in spec[:2] if d.isdigit()]
    if any("*" in spec[:2] for spec in specs):
        numbers += [abs(v) for v in items if isinstance(v, int)]
    widest = max(numbers, default=0)
    conversions = "".join(spec[2] for spec in specs)
    largest = _largest_text(state, items, conversions, template)
    return len(text) + len(specs) * (largest + widest)


def format_size(state: RenderState, template: str, values: list[Any]) -> int:
    """An upper bound of ``len(template.format(...))`` over the arguments ``values``."""
    fields, widest, nested, conversions = 0, 0, False, ""
    for _, field, spec, conversion in string.Formatter().parse(template):
        if field is None:
            continue
        fields += 1
        conversions += conversion or ""
        widest = max([widest, *(_number(d) for d in re.findall(r"\d+", spec or ""))])
        nested = nested or "{" in (spec or "")
    if nested:  # a width from an argument
        widest = max([widest, *(abs(v) for v in values if isinstance(v, int))])
    largest = _largest_text(state, values, conversions, template)
    return len(template) + fields * (largest + widest)


# -- the predictors --------------------------------------------------------------------------


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _width(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
    """center(width): at least ``width`` characters."""
    width = _arg(args, kwargs, 0, "width", 80)
    if isinstance(width, int):
        state.check_length(width, "a string")
    return value, args, kwargs


def _indent(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
    """indent(width): the indention (``width`` spaces, or a string) on every line."""
    width = _arg(args, kwargs, 0, "width", 4)
    unit = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    state.check_length(unit, "a string")
    lines = len(str(value).splitlines()) + 1 if isinstance(value, str) else 1
    state.check_length(len(as_text(state, value)) + lines * (unit + 1), "a string")
    return value, args, kwargs


def _wordwrap(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
    """wordwrap(width, ..., wrapstring): at most one wrapstring per character."""
    wrapstring = _arg(args, kwargs, 2, "wrapstring", None) or "\n"
    size = len(as_text(state, value)) * (1 + len(as_text(state, wrapstring)))
    state.check_length(size + len(wrapstring), "a string")
    return value, args, kwargs


def _format(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
    """format(*args, **kwargs): `value % (kwargs or args)`."""
    state.check_length(printf_size(state, as_text(state, value), kwargs or args), "a string")
    return value, args, kwargs


def replace_size(text: Any, old: Any, new: Any, count: Any) -> int:
    """An upper bound of ``len(text.replace(old, new, count))`` (a `Markup` escapes `new`)."""
    found = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(escaping(text) * len(new) - len(old), 0)


def _replace(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
    old = as_text(state, _arg(args, kwargs, 0, "old", ""))
    new = as_text(state, _arg(args, kwargs, 1, "new", ""))
    count = _arg(args, kwargs, 2, "count", None)
    state.check_length(replace_size(as_text(state, value), old, new, count), "a string")
    return value, args, kwargs


def _join(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
    """join(d, attribute): the items (their attribute, taken now) as text, d between."""
    separator = as_text(state, _arg(args, kwargs, 0, "d", ""))
    attribute = _arg(args, kwargs, 1, "attribute", None)
    if attribute is not None:
        value = map(make_attrgetter(context.environment, attribute), value)
    items = bounded_list(state, value)
    size = len(separator) * max(len(items) - 1, 0)
    for item in items:
        size += text_size(item, state.max_value)
        state.check_length(size, "a string")
    return items, (separator,), {}


def _count(index: int, name: str) -> Predictor:
    """batch(linecount) and slice(slices): that many lists (or items) made."""

    def predict(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
        number = _arg(args, kwargs, index, name, 0)
        if isinstance(number, int):
            state.check_length(number, "a collection")
        return value, args, kwargs

    return predict


def _listed(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
    return (value if isinstance(value, str) else bounded_list(state, value)), args, kwargs


def _textual(factor: int) -> Predictor:
    """string, xmlattr, urlencode: the value as text, escaped up to ``factor`` times."""

    def predict(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
        state.check_length(factor * text_size(value, state.max_value), "a string")
        return value, args, kwargs

    return predict


def _urlize(state: RenderState, context: Any, value: Any, args: tuple, kwargs: dict) -> tuple:
    """urlize(..., target, rel): each link (at least 4 characters) gets a tag around it."""
    extras = sum(len(as_text(state, _arg(args, kwargs, i, name, None) or ""))
                 for i, name in ((2, "target"), (3, "rel"))) + 64  # fmt: skip
    text = as_text(state, value)
    state.check_length(12 * len(text) + (len(text) // 4 + 1) * extras, "a string")
    return value, args, kwargs


PREDICTORS: dict[str, Predictor] = {
    "center": _width, "indent": _indent, "wordwrap": _wordwrap, "format": _format,
    "replace": _replace, "join": _join, "batch": _count(0, "linecount"),
    "slice": _count(0, "slices"), "list": _listed, "string": _textual(1),
    "xmlattr": _textual(6), "urlencode": _textual(12), "urlize": _urlize,
}  # fmt: skip
# jinja's filters whose output is no larger than a small multiple of their input (escaping:
# at most 6 times; changing case: at most 3), or not text at all. A filter in neither this
# nor PREDICTORS fails tests/engine/test_chat_template_bounds.py: a jinja upgrade that adds
# one is classified before it is served.
PROPORTIONAL = frozenset({
    "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape",
    "filesizeformat", "first", "float", "forceescape", "groupby", "int", "items", "last",
    "length", "lower", "map", "max", "min", "random", "reject", "rejectattr", "reverse",
    "round", "safe", "select", "selectattr", "sort", "striptags", "sum", "title", "tojson",
    "trim", "truncate", "unique", "upper", "wordcount",
})  # fmt: skip
