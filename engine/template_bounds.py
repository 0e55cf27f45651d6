"""The bounds of one chat template render: its time, the rendered prompt's size, the size of
any value it builds, and the memory it allocates in all.

A model's chat template is Jinja code from whoever made the file, run on every chat
request. jinja2's sandbox keeps it from Python's internals, not from spending: two nested
loops of 100,000 iterations hang a request, `'x' * 10**10` kills the process. The sandbox
of engine/template_sandbox.py calls this module at every place a template can spend, and
`RenderState` is one render's bounds and what it has spent, current on its thread.

A bound is a `TemplateBoundError`; which bound it was (`.bound`) tells the caller whose
fault it may be (server/chat_renderer.py: the request's, or the template's).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from jinja2.utils import Namespace

# Seconds a render may take. A normal chat renders in ~30-45 us and the largest prompt the
# default model's context takes (640 KB, 1,000 messages) in 5-10 ms (bench/chat_template.py):
# 2 s is 200 times that, and keeps a hostile template from holding a render thread long.
DEFAULT_TIMEOUT_S = 2.0
# The rendered prompt's bound where no context says better (a template rendered outside
# the server, e.g. by `LLM.apply_chat_template`): 16 MiB, more than any context holds.
DEFAULT_MAX_PROMPT_BYTES = 16 << 20
# A render may allocate this many times its prompt bound in all, and never less than the
# floor: legitimate templates build the prompt once, from values no larger than it.
TOTAL_PER_PROMPT = 8
MIN_TOTAL_BYTES = 64 << 20
# What one item of a list, tuple or dict costs the memory bound: its pointer and, at most,
# a small object of its own (a 1-character string is 50 bytes).
ITEM_BYTES = 64
# No chat template needs a larger integer; `x * x` in a loop would double its size a turn.
MAX_INT_BITS = 1 << 16
# A render that runs longer than YIELD_EVERY_S gives the GIL up for YIELD_FOR_S that often:
# otherwise a template spinning on its thread takes the GIL back at every switch, and each
# of the many handoffs another request's work needs (the event loop, its own render, the
# engine thread) waits up to 5 ms: a one-token request to another model took the whole 1 s
# of a spin. A normal render (~30 us) never reaches it; the largest (5-10 ms) by ~1 ms.
YIELD_EVERY_S = 0.002
YIELD_FOR_S = 0.0005

# A render stopped after building this much: the memory it freed is handed back to the OS.
TRIM_AFTER_BYTES = 16 << 20

BOUNDS = ("time", "prompt size", "value size", "memory", "recursion")


@dataclass(frozen=True)
class RenderLimits:
    """A render's bounds (docs/limits.md): `timeout_s` seconds, a rendered prompt of at most
    `max_prompt_bytes` UTF-8 bytes; no value (a string, list, tuple, dict or range) longer
    than the prompt's bound in characters or items, and `max_total_bytes` allocated."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES

    @property
    def max_value(self) -> int:
        return self.max_prompt_bytes

    @property
    def max_total_bytes(self) -> int:
        return max(MIN_TOTAL_BYTES, TOTAL_PER_PROMPT * self.max_prompt_bytes)


DEFAULT_LIMITS = RenderLimits()


class TemplateBoundError(Exception):
    """A render stopped at one of its bounds; `bound` says which (one of `BOUNDS`), the
    message what the template did ("the chat template ran for more than...")."""

    def __init__(self, bound: str, message: str) -> None:
        super().__init__(message)
        self.bound = bound


class RenderState:
    """One render's deadline and allocation so far; the sandbox's hooks call it. ``with
    RenderState(limits) as state:`` this thread renders under ``limits``, and Python's own
    limits met on the way (recursion, memory) are `TemplateBoundError`s too."""

    __slots__ = ("_previous", "deadline", "limits", "max_total", "max_value", "next_check",
                 "next_yield", "spent")  # fmt: skip

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.start_clock()
        # `limits.max_value` and `.max_total_bytes`, inline: a state is made per render
        self.max_value = limits.max_prompt_bytes
        self.max_total = max(MIN_TOTAL_BYTES, TOTAL_PER_PROMPT * limits.max_prompt_bytes)
        self.spent = 0

    def __enter__(self) -> RenderState:
        self._previous, _LOCAL.state = _LOCAL.state, self
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> None:  # fmt: skip
        _LOCAL.state = self._previous
        if kind is not None and self.spent >= TRIM_AFTER_BYTES:
            _give_back_freed_memory()
        if kind is not None and issubclass(kind, RecursionError):
            raise TemplateBoundError(
                "recursion", "the chat template recursed past Python's stack limit"
            ) from None
        if kind is not None and issubclass(kind, MemoryError):
            raise TemplateBoundError("memory", "the chat template ran out of memory") from None

    def start_clock(self) -> None:
        now = time.monotonic()
        self.deadline = now + self.limits.timeout_s
        self.next_yield = now + YIELD_EVERY_S
        self.next_check = min(self.deadline, self.next_yield)  # what a loop turn compares

    def check_time(self) -> None:
        """Past the deadline: `TemplateBoundError`; past `next_yield`: the GIL given up."""
        now = time.monotonic()
        if now > self.deadline:
            raise TemplateBoundError("time", "the chat template ran for more than its "
                                     f"{self.limits.timeout_s:g} s time bound")  # fmt: skip
        if now > self.next_yield:
            time.sleep(YIELD_FOR_S)
            self.next_yield = time.monotonic() + YIELD_EVERY_S
            self.next_check = min(self.deadline, self.next_yield)

    def refuse(self, what: str, size: int) -> NoReturn:
        unit = "characters" if what == "a string" else "items"
        raise TemplateBoundError(
            "value size", f"the chat template would build {what} of {size:,} {unit}, past "
            f"the {self.max_value:,} one value may hold",
        )  # fmt: skip

    def check_length(self, size: int, what: str = "a value") -> None:
        if size > self.max_value:
            self.refuse(what, size)

    def charge(self, nbytes: int) -> None:
        self.spent += nbytes
        if self.spent > self.max_total:
            raise TemplateBoundError("memory", "the chat template allocated more than its "
                                     f"memory bound of {self.max_total:,} bytes")  # fmt: skip

    def produced(self, value: Any) -> Any:
        """``value``, just built by the template: refused past the value bound, else
        counted against the memory bound."""
        kind = type(value)
        if kind is str or kind is bytes or isinstance(value, (str, bytes)):
            size = len(value)
            self.check_length(size, "a string")
            self.charge(size)
        elif kind in _CONTAINERS or isinstance(value, (list, tuple, dict, set, frozenset)):
            size = len(value)
            self.check_length(size, "a collection")
            self.charge(size * ITEM_BYTES)
        return value


_CONTAINERS = frozenset({list, tuple, dict, set, frozenset})


def _give_back_freed_memory() -> None:
    """glibc keeps freed heap memory for reuse, and the blocks a stopped render freed (up to
    its memory bound, each below glibc's mmap threshold) could stay in the process's RSS
    behind one block still in use above them: `malloc_trim(0)` returns every free page
    (a few ms, only after such a render; nothing where the C library has no such call)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class _Local(threading.local):
    state: RenderState | None = None


_LOCAL = _Local()


def current() -> RenderState:
    """This thread's render; outside one (a constant folded while compiling), a fresh state
    of the default bounds."""
    state = _LOCAL.state
    return state if state is not None else RenderState(DEFAULT_LIMITS)


def render_template(template: Any, variables: dict[str, Any], state: RenderState) -> str:
    """``template`` rendered with ``variables`` (as jinja's `Template.render` does it, its
    errors pointing at the template's lines), its output collected under ``state``."""
    try:
        return collect_output(template.root_render_func(template.new_context(variables)), state)
    except TemplateBoundError:
        raise
    except Exception:
        template.environment.handle_exception()
        raise  # (handle_exception raises)


def collect_output(chunks: Iterable[str], state: RenderState) -> str:
    """A template's output, chunk by chunk against the prompt's bound. (Not the deadline:
    a template without loops, calls or recursion runs in time its length bounds, and each
    of those checks it.)"""
    limit = state.limits.max_prompt_bytes
    out: list[str] = []
    append, size = out.append, 0
    for chunk in chunks:
        size += len(chunk)
        if size > limit:  # characters: each is at least one byte
            _too_long(size, limit)
        append(chunk)
    text = "".join(out)
    if size * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
        _too_long(len(text.encode("utf-8", "surrogatepass")), limit)
    return text


def _too_long(size: int, limit: int) -> NoReturn:
    raise TemplateBoundError("prompt size", f"the chat template rendered a prompt of more than "
                             f"{limit:,} bytes ({size:,} so far)")  # fmt: skip


def join_bounded(pieces: Iterable[str], state: RenderState) -> str:
    """``pieces`` joined, refused as soon as they run past the value bound."""
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        state.check_length(size, "a string")
        out.append(piece)
    state.charge(size)
    return "".join(out)


# -- what converting a value to text would cost, without converting it ---------------------


def text_size(value: Any, limit: int, as_json: bool = False) -> int:
    """At least ``len(str(value))`` (``as_json``: of its compact JSON), counted without
    building it, and returned as soon as it passes ``limit``: `str([s] * n)` is n copies of
    s, so a list of a few pointers can be a huge string."""
    if type(value) is str:
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            total += _quoted_size(item, as_json)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 8 + 2 * len(item)
            stack.extend(item)
        elif isinstance(item, dict):
            total += 8 + 4 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (type({}.keys()), type({}.values()), type({}.items()))):
            total += 16
            stack.extend(item)
        elif isinstance(item, Namespace):  # its repr shows its attributes
            total += 16
            stack.append(object.__getattribute__(item, "_Namespace__attrs"))
        elif isinstance(item, (bytes, bytearray)):
            total += 4 * len(item) + 3
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 2  # decimal digits, sign: an upper bound
        else:  # floats, None, booleans, the sandbox's own objects: short reprs
            total += 96
    return total


def _quoted_size(text: str, as_json: bool) -> int:
    """The length of ``text`` quoted inside a container's repr, or as a JSON string."""
    if text.isascii() and text.isprintable():  # only quotes and backslashes are escaped
        return len(text) + 2 + text.count("\\") + text.count('"' if as_json else "'")
    if as_json:
        return len(json.dumps(text, ensure_ascii=False))
    return len(repr(text))
