"""A model's chat template: its bounds, and one check at load under them.

A render's bounds (engine/template_bounds.py) for a model: the `--chat-template-timeout`,
and a rendered prompt no larger than the model's context could take, `max_model_len`
tokens of `bytes_per_token` bytes each (its vocabulary's longest token), so the bound never
refuses a prompt that would have fit.

At load the template renders a few probe conversations under those bounds. A template that
breaks a bound, does not compile, or reaches for Python's internals on them would fail
every request (or is hostile): the model is refused with one `ModelFileError` line. One that
only refuses a probe's messages (`raise_exception("System role not supported")`, a template
without tools that trips over a tool message) is served: real templates do that, and a
request sending such messages gets its 400.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Any

import jinja2

from engine.errors import ModelFileError
from engine.gguf_chat_template import render_chat
from engine.template_bounds import RenderLimits, TemplateBoundError

# The most bytes one token is taken to stand for: a vocabulary with a longer token (a crafted
# one) does not raise every render's bound past what real ones need (Llama 3's longest: 128).
MAX_BYTES_PER_TOKEN = 256
# The longest template source compiled: real ones are under 50 KB; 256 KiB of dense Jinja
# compiles in ~1.5 s on a 2-core machine (a 3 MiB one took 18 s and 1.3 GB).
MAX_TEMPLATE_BYTES = 256 << 10

_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
_CALL = {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}  # fmt: skip
_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_USER = {"role": "user", "content": "What is the weather in Paris?"}
# name -> (messages, tools): each rendered with the generation prompt, as chat requests are
PROBES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "one user message": ([_USER], None),
    "a system prompt and three turns": (
        [_SYSTEM, _USER, {"role": "assistant", "content": "Sunny, 18 C."},
         {"role": "user", "content": "And tomorrow?"}], None),
    "tools, a call and its result": (
        [_SYSTEM, _USER, {"role": "assistant", "content": "", "tool_calls": [_CALL]},
         {"role": "tool", "content": "Sunny, 18 C.", "tool_call_id": "call_1",
          "name": "get_weather"}], [_TOOL]),
}  # fmt: skip

_BYTES_PER_TOKEN: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
# The same, by the tokenizer's file (its path, size and modification time): each load of a
# model reads a new tokenizer object, and measuring its vocabulary took 30-60 ms of it.
_BY_FILE: dict[tuple[str, int, int], int] = {}


def bytes_per_token(tokenizer: Any) -> int:
    """The most bytes of text one token of ``tokenizer`` stands for: its vocabulary's longest
    token, at most `MAX_BYTES_PER_TOKEN`. A byte-level BPE token spells each byte as one
    character; any other is measured in UTF-8, at least its text's length (SentencePiece
    spells a space in three bytes, a byte fallback in six). Cached per tokenizer and per
    tokenizer file."""
    with contextlib.suppress(KeyError, TypeError):
        return _BYTES_PER_TOKEN[tokenizer]
    key = _file_key(tokenizer)
    size = _BY_FILE.get(key) if key is not None else None
    if size is None:
        size = _longest_token(tokenizer)
        if key is not None:
            _BY_FILE[key] = size
    with contextlib.suppress(TypeError):  # not weakly referable: looked up by file only
        _BYTES_PER_TOKEN[tokenizer] = size
    return size


def _longest_token(tokenizer: Any) -> int:
    from engine.gguf_tokenizer import byte_alphabet  # (numpy, gguf: not at the server's import)

    alphabet = set(byte_alphabet().values()) if _byte_level(tokenizer) else set()
    longest = max((len(t) if alphabet.issuperset(t) else len(t.encode("utf-8", "surrogatepass"))
                   for t in tokenizer.get_vocab()), default=1)  # fmt: skip
    return max(1, min(longest, MAX_BYTES_PER_TOKEN))


def _file_key(tokenizer: Any) -> tuple[str, int, int] | None:
    """Where ``tokenizer`` was read from, as a cache key: its tokenizer.json, if it has one."""
    folder = getattr(tokenizer, "name_or_path", None)
    if not folder:
        return None
    try:
        file = (Path(folder) / "tokenizer.json").resolve()
        stat = file.stat()
    except (OSError, ValueError):
        return None
    return str(file), stat.st_size, stat.st_mtime_ns


def _byte_level(tokenizer: Any) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def chat_template_limits(tokenizer: Any, max_model_len: int, timeout_s: float) -> RenderLimits:
    """The bounds of a render of this model's template (docs/limits.md)."""
    return RenderLimits(timeout_s, max_model_len * bytes_per_token(tokenizer))


def chat_template_source(tokenizer: Any, tools: Any = None) -> str | None:
    """The template a chat renders with, as transformers picks it: a tokenizer may hold
    named templates (`default`, and `tool_use` for a request with tools)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") if tools and "tool_use" in template \
            else template.get("default")  # fmt: skip
    return template if isinstance(template, str) and template else None


def check_chat_template(tokenizer: Any, limits: RenderLimits, path: str | Path) -> None:
    """`ModelFileError` naming ``path`` when the model's template breaks ``limits``, does not
    compile, or reaches for Python's internals on a probe conversation (module doc)."""
    sources = {chat_template_source(tokenizer), chat_template_source(tokenizer, [_TOOL])}
    for source in sorted(s for s in sources if s is not None):
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > MAX_TEMPLATE_BYTES:
            raise ModelFileError(f"{path}: its chat template is {size:,} bytes, over the "
                                 f"{MAX_TEMPLATE_BYTES:,} a template may be")  # fmt: skip
        for probe, (messages, tools) in PROBES.items():
            _probe(tokenizer, source, messages, tools, limits, f"{path}: ", probe)


def _probe(
    tokenizer: Any, source: str, messages: list[dict[str, Any]], tools: Any,
    limits: RenderLimits, prefix: str, probe: str,
) -> None:  # fmt: skip
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    try:
        render_chat(source, messages, special, tools, None, True, limits=limits)
    except TemplateBoundError as exc:
        fault = f"{exc} rendering a probe chat ({probe}); the model is refused (docs/limits.md)"
    except jinja2.TemplateSyntaxError as exc:
        fault = f"its chat template does not compile: {exc.message} (line {exc.lineno})"
    except jinja2.exceptions.SecurityError as exc:
        fault = f"its chat template reaches for Python's internals ({exc}); the model is refused"
    except Exception:  # noqa: BLE001 - the template refused the probe's messages: served
        return
    else:
        return
    raise ModelFileError(prefix + " ".join(fault.split()))  # one line, whatever jinja wrote
