"""`BoundedSandbox`: jinja2's immutable sandbox, with a render's bounds at each place a
template can spend time or memory (engine/template_bounds.py says which bounds).

jinja's sandbox has hooks for some of those places, its code generator for the rest:

- `call_binop` (`*`, `**`, `%`): `'x' * n` and a `%` width are refused before they run,
  as are integers past 65,536 bits;
- `call` (macros, `loop()`, methods): the deadline, and the str methods that grow a string
  (`center`, `replace`, `join`, `format`...) predicted before they run;
- a `+` chain (`a + b + c`) is measured once added (`environment.checked`; a chain of more
  than `SHORT_CHAIN` values at each step, `environment.add`), `~` compiles to
  `environment.str_join`, a slice to `environment.slice_item`, and each `{% for %}`
  iterates through the loop guard of engine/template_filters.py;
- `concat` (block, macro and `{% set %}` bodies) and `finalize` (`{{ x }}` of a list) are
  measured before they are built; filters and `range` are engine/template_filters.py's.
"""

from __future__ import annotations

from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.template_bounds import (
    ITEM_BYTES,
    MAX_INT_BITS,
    RenderState,
    TemplateBoundError,
    current,
    text_size,
)
from engine.template_filters import (
    LEFT_OUT,
    LOOP_GUARD,
    as_text,
    bounded_filter,
    bounded_list,
    bounded_range,
    bounded_tojson,
    escaping,
    format_size,
    linear_sum,
    loop_guard,
    printf_size,
    replace_size,
)

_REPLACED_FILTERS = {"sum": linear_sum, "tojson": bounded_tojson}
# The longest `a + b + ...` chain added natively before its sum is measured.
SHORT_CHAIN = 8


class _BoundedCodeGenerator(CodeGenerator):
    """jinja's code generator, routing what its sandbox hooks do not see through them."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        for loop in node.find_all(nodes.For):  # every loop checks the deadline each turn
            loop.iter = nodes.Filter(loop.iter, LOOP_GUARD, [], [], None, None,
                                     lineno=loop.iter.lineno)  # fmt: skip
        # A sum written straight out (`{{ a + b }}`) is kept by no one: the output's own
        # bound measures it, once it is built.
        self._written = {id(child) for output in node.find_all(nodes.Output)
                         for child in output.nodes if isinstance(child, nodes.Add)}  # fmt: skip
        super().visit_Template(node, frame)

    def visit_Add(self, node: nodes.Add, frame: Frame) -> None:
        """`a + b + c`: a short chain (a template builds its lines that way) added as Python
        adds it, its sum then measured (`environment.checked`: at most `SHORT_CHAIN` values
        added before it, so at most that many times the largest) unless it is written out
        as it is; a longer one through `environment.add`, which measures each partial sum."""
        operands, left = [node.right], node.left
        while isinstance(left, nodes.Add):
            operands.append(left.right)
            left = left.left
        operands.append(left)
        operands.reverse()
        short = len(operands) <= SHORT_CHAIN
        written = short and id(node) in self._written
        self.write("(" if written else "environment.checked((" if short else "environment.add(")
        for i, operand in enumerate(operands):
            if i:
                self.write(" + " if short else ", ")
            self.visit(operand, frame)
        self.write(")" if written else "))" if short else ")")

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.str_join((")
        for operand in node.nodes:
            self.visit(operand, frame)
            self.write(", ")
        self.write("))")

    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        if not isinstance(node.arg, nodes.Slice):  # jinja's sandbox sees it already
            super().visit_Getitem(node, frame)
            return
        self.write("environment.slice_item(")  # jinja writes a slice as Python's, unseen
        self.visit(node.node, frame)
        self.write(", slice(")
        for part in (node.arg.start, node.arg.stop, node.arg.step):
            if part is None:
                self.write("None")
            else:
                self.visit(part, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose renders keep to the bounds of the `RenderState` they
    run in (engine/template_bounds.py). ``filters`` and ``globals`` are added to jinja's."""

    intercepted_binops = frozenset({"*", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(
        self,
        filters: dict[str, Any] | None = None,
        globals: dict[str, Any] | None = None,  # noqa: A002 - jinja's name
        **options: Any,
    ) -> None:
        super().__init__(finalize=_finalize, **options)
        self.concat = _concat  # the generated code's `concat`, bodies of blocks and macros
        merged = {**self.filters, **_REPLACED_FILTERS, **(filters or {})}
        self.filters = {name: bounded_filter(name, f) for name, f in merged.items()
                        if name not in LEFT_OUT}  # fmt: skip
        self.filters[LOOP_GUARD] = loop_guard
        self.globals.pop("lipsum", None)
        self.globals.update(globals or {}, range=bounded_range)

    def checked(self, value: Any) -> Any:
        """A short chain's sum, measured (`produced`, with str's case first)."""
        if type(value) is str:
            state = current()
            if len(value) > state.max_value:
                state.refuse("a string", len(value))
            state.spent += len(value)
            if state.spent > state.max_total:
                state.charge(0)
            return value
        return current().produced(value)

    def add(self, first: Any, *rest: Any) -> Any:
        """`first + rest[0] + ...`, each sum refused past the value bound (so a sum of n
        values each within it allocates at most twice the bound) and counted."""
        state = current()
        limit, spent, result = state.max_value, 0, first
        for operand in rest:
            result = result + operand
            if type(result) is str:  # the common case first
                spent += len(result)
                if len(result) > limit:
                    state.refuse("a string", len(result))
            elif isinstance(result, (str, bytes, list, tuple)):
                size = len(result)
                if size > limit:
                    state.refuse("a concatenation", size)
                spent += size if isinstance(result, (str, bytes)) else size * ITEM_BYTES
        if spent:
            state.charge(spent)
        return result

    def str_join(self, pieces: tuple[Any, ...]) -> str:
        state = current()
        texts = [p if type(p) is str else as_text(state, p) for p in pieces]
        size = sum(map(len, texts))
        state.check_length(size, "a string")
        state.charge(size)
        return "".join(texts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        state = current()
        if operator == "*":
            _check_repeat(state, left, right)
        elif operator == "**":
            _check_power(state, left, right)
        elif isinstance(left, (str, bytes)):  # "%": printf formatting
            state.check_length(printf_size(state, left, right), "a string")
        return state.produced(self.binop_table[operator](left, right))

    def slice_item(self, obj: Any, part: slice) -> Any:
        return current().produced(obj[part])  # as jinja's own code slices, counted

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        state = current()
        state.check_time()
        method = getattr(obj, "__wrapped__", obj)  # str.format: the sandbox's wrapper
        owner = getattr(method, "__self__", None)
        if isinstance(owner, (str, bytes, int)):
            args = _check_method(state, owner, method.__name__, args, kwargs)
        return state.produced(super().call(context, obj, *args, **kwargs))


def _check_repeat(state: RenderState, left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > MAX_INT_BITS:
            _huge_integer(left.bit_length() + right.bit_length())
        return
    sequence, times = (left, right) if isinstance(right, int) else (right, left)
    if isinstance(sequence, (str, bytes, list, tuple)) and isinstance(times, int):
        state.check_length(len(sequence) * max(times, 0), "a repeated value")


def _check_power(state: RenderState, base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        bits = base.bit_length() * exponent
        if bits > MAX_INT_BITS:
            _huge_integer(bits)


def _huge_integer(bits: int) -> None:
    raise TemplateBoundError(
        "value size", f"the chat template would build an integer of about {bits:,} bits, "
        f"past the {MAX_INT_BITS:,} an integer may hold",
    )  # fmt: skip


def _check_method(state: RenderState, owner: Any, name: str, args: tuple, kwargs: dict) -> tuple:
    """A str (bytes, int) method's result, predicted before it runs when it can outgrow
    the string; the arguments to call it with (join's iterable, counted into a list)."""
    arg = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        width = kwargs.get("width", arg)
        if isinstance(width, int):
            state.check_length(width, "a string")
    elif name == "expandtabs":
        size = kwargs.get("tabsize", 8 if arg is None else arg)
        tab = "\t" if isinstance(owner, str) else b"\t"
        if isinstance(size, int):
            state.check_length(len(owner) + owner.count(tab) * max(size, 0), "a string")
    elif name == "replace" and len(args) >= 2 and _same_kind(owner, *args[:2]):
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        state.check_length(replace_size(owner, args[0], args[1], count), "a string")
    elif name == "join" and args:
        items = bounded_list(state, args[0])
        sizes = sum(len(i) for i in items if isinstance(i, (str, bytes))) * escaping(owner)
        state.check_length(sizes + len(owner) * max(len(items) - 1, 0), "a string")
        return (items, *args[1:])
    elif name == "translate" and args:
        state.check_length(len(owner) * _longest_mapping(args[0]), "a string")
    elif name in ("format", "format_map") and isinstance(owner, str):
        values = list(arg.values()) if name == "format_map" and hasattr(arg, "values") \
            else [*args, *kwargs.values()]  # fmt: skip
        state.check_length(format_size(state, owner, values), "a string")
    elif name == "to_bytes":
        length = kwargs.get("length", 1 if arg is None else arg)
        if isinstance(length, int):
            state.check_length(length, "a string")
    return args


def _same_kind(owner: Any, *values: Any) -> bool:
    kind = str if isinstance(owner, str) else bytes
    return all(isinstance(v, kind) for v in values)


def _longest_mapping(table: Any) -> int:
    """The longest replacement a `translate` table gives one character (at least 1)."""
    values = table.values() if isinstance(table, dict) else table \
        if isinstance(table, (list, tuple)) else ()  # fmt: skip
    return max([1, *(len(v) for v in values if isinstance(v, (str, bytes)))])


def _concat(pieces: Any) -> str:
    state = current()
    state.check_time()
    pieces = pieces if isinstance(pieces, list) else list(pieces)
    size = sum(map(len, pieces))
    state.check_length(size, "a string")
    state.charge(size)
    return "".join(pieces)


def _finalize(value: Any) -> Any:
    """What `{{ value }}` writes: a list, dict, ... measured before `str()` builds it."""
    if type(value) is not str and not isinstance(value, (int, float)) and value is not None:
        state = current()
        state.check_length(text_size(value, state.max_value), "a string")
    return value
