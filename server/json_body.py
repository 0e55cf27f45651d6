"""One reader for all JSON a client sends: request bodies, and JSON text inside them.

Python's json parser recurses once per level of nesting, and so does every walk after it
(pydantic's validation, our own helpers): a body nested a few hundred levels deep ended in a
RecursionError, a 500 with a traceback of hundreds of KB in the log. So the nesting is
measured first, on the text and without recursion, and anything nested deeper than
MAX_DEPTH levels is refused (a 400 that says where); no real request nests past a few
dozen. Every walk over a parsed body below is iterative too.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from server.errors import bad_request

# Arrays and objects inside one another, the body's own object included.
MAX_DEPTH = 64
# A too-deep value's param names its first few steps: enough to name any request field.
_PARAM_PARTS = 6
_KEY_CHARS = 64

# Tokens for locating a too-deep value: strings (escapes included), brackets, separators.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:]', re.DOTALL)
# Tokens read while locating it; past this the error names no place (a bound on the work).
_LOCATE_BUDGET = 200_000
_NOT_BRACKET_OR_QUOTE = bytes(range(256)).translate(None, b'[]{}"')
_QUOTED = re.compile(rb'"[^"]*"')
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # int8 +1 and -1


class JsonTooDeepError(ValueError):
    """The text nests arrays and objects deeper than the limit; `path` leads to the place."""

    def __init__(self, path: tuple[str, ...], limit: int) -> None:
        self.path = path
        self.limit = limit
        where = ".".join(path[:_PARAM_PARTS]) or "the body"
        super().__init__(
            f"nests arrays and objects more than {limit} levels deep (in `{where}`); "
            f"the limit is {limit}"
        )


def check_depth(text: str, limit: int = MAX_DEPTH) -> None:
    """JsonTooDeepError when `text` opens arrays and objects more than `limit` deep.

    Without recursion, in C loops: the brackets outside strings become steps of +1 and -1
    whose running sum is the depth. Text that is not JSON may pass: the parser refuses it.
    """
    steps = np.frombuffer(_bracket_steps(text), dtype=np.int8)
    if steps.size > limit and int(steps.cumsum(dtype=np.int32).max()) > limit:
        raise JsonTooDeepError(_too_deep_path(text, limit), limit)


def _bracket_steps(text: str) -> bytes:
    """The brackets of `text` outside its strings, as int8 steps: +1 opens, -1 closes."""
    data = text.encode("utf-8", "surrogatepass")  # brackets and quotes are single bytes
    # Escapes occur only inside strings; with them gone, quotes only open and close strings.
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    data = data.translate(None, _NOT_BRACKET_OR_QUOTE)
    # Two adjacent quotes close a string and open the next (or enclose nothing): dropping
    # them joins two strings, leaving every bracket inside or outside as it was.
    data = data.replace(b'""', b"")
    data = _QUOTED.sub(b"", data)  # the strings that hold brackets
    return data.translate(_STEPS, b'"')  # an unterminated string's quote: not JSON anyway


def _too_deep_path(text: str, limit: int) -> tuple[str, ...]:
    """The keys and indexes down to the first value nested deeper than `limit`; () when it
    is not found within the first _LOCATE_BUDGET tokens."""
    stack: list[list[Any]] = []  # per open array or object: [is_array, index or key]
    last_string = ""
    for count, match in enumerate(_TOKEN.finditer(text)):
        token = match.group()
        if count == _LOCATE_BUDGET:
            break
        if token[0] == '"':
            last_string = token
        elif token in "[{":
            if len(stack) == limit:
                return tuple(str(place) for _, place in stack if place is not None)
            stack.append([token == "[", 0 if token == "[" else None])
        elif token in "]}":
            if stack:
                stack.pop()
        elif stack and token == "," and stack[-1][0]:
            stack[-1][1] += 1
        elif stack and token == ":" and not stack[-1][0]:
            stack[-1][1] = _readable_key(last_string)
    return ()


def _readable_key(token: str) -> str:
    key = json.loads(token)  # one string: no nesting
    return key.encode("utf-8", "backslashreplace").decode()[:_KEY_CHARS]


def loads(text: str | bytes, limit: int = MAX_DEPTH) -> Any:
    """json.loads with the nesting limit: JsonTooDeepError (a ValueError) past it, a
    ValueError worded for a client when the text is not JSON."""
    if isinstance(text, bytes | bytearray):
        text = _decode(bytes(text))
    check_depth(text, limit)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except RecursionError:  # cannot happen after check_depth; never let it become a 500
        raise JsonTooDeepError((), limit) from None
    except ValueError:  # the only other: an integer longer than int() reads
        raise ValueError("a number has more digits than this server reads (4300 at most)") from None


def _decode(raw: bytes) -> str:
    # As json.loads(bytes): UTF-8 (or the UTF-16/32 its first bytes show), surrogates kept so
    # that first_unencodable_text names the field that holds one.
    encoding = json.detect_encoding(raw)
    try:
        return raw.decode(encoding, "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ValueError(f"it is not valid {exc.encoding.upper()} (at byte {exc.start})") from None


def read_json_body(raw: bytes) -> Any:
    """A request body parsed; a 400 in the OpenAI shape when it is too deep, not JSON, or
    holds text that is not Unicode."""
    try:
        body = loads(raw)
    except JsonTooDeepError as exc:
        param = ".".join(exc.path[:_PARAM_PARTS]) or None
        raise bad_request(f"The request body {exc}.", param=param, code="json_too_deep") from None
    except ValueError as exc:
        raise bad_request(f"Malformed JSON body: {exc}.", code="invalid_json") from None
    reject_unencodable_text(body)
    return body


def loads_field(text: str, param: str) -> Any:
    """JSON text inside a body (a schema sent as a string): a 400 naming `param` if bad."""
    try:
        return loads(text)
    except JsonTooDeepError as exc:
        raise bad_request(f"`{param}` {exc}.", param=param) from None
    except ValueError as exc:
        raise bad_request(f"`{param}` is not valid JSON: {exc}.", param=param) from None


_Place = tuple[Any, str] | None  # (the parent's place, this key); None: the body itself


def first_unencodable_text(value: Any) -> tuple[str, ...] | None:
    """The path of the first string in a parsed JSON value that UTF-8 cannot encode.

    JSON may escape lone surrogates ("\\ud800"); no tokenizer, log or response can carry
    them. A bad object key is reported at its object's path. Iterative, in document order;
    each place is (parent's place, key), a path only built for the string it reports.
    """
    stack: list[tuple[Any, _Place]] = [(value, None)]
    while stack:
        node, place = stack.pop()
        if isinstance(node, str):
            if not _is_utf8(node):
                return _path(place)
        elif isinstance(node, dict):
            if not all(_is_utf8(key) for key in node):
                return _path(place)
            stack.extend((item, (place, key)) for key, item in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((node[i], (place, str(i))) for i in range(len(node) - 1, -1, -1))
    return None


def _path(place: _Place) -> tuple[str, ...]:
    keys: list[str] = []
    while place is not None:
        place, key = place
        keys.append(key)
    return tuple(reversed(keys))


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def reject_unencodable_text(body: Any) -> None:
    """400 naming the field whose text holds a lone surrogate, before anything reads it."""
    path = first_unencodable_text(body)
    if path is None:
        return
    field = ".".join(path) or None
    raise bad_request(
        f"Invalid value for '{field or 'body'}': text must be valid Unicode; it contains a "
        "lone surrogate (such as \\ud800) that cannot be encoded as UTF-8.",
        param=field,
    )
