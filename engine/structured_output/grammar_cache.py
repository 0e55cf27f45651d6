"""Compiled grammars for one tokenizer: each spec compiled once, by whichever thread asks first.

Compiling turns a spec into xgrammar's per-state token masks over this tokenizer's
vocabulary (a few ms for a small schema, ~0.1 s for a large one). The cache is keyed by
the (frozen) `StructuredOutputs`; the tokenizer is fixed per cache (one per engine). Threads that
ask for a spec being compiled wait for that one compilation instead of starting another.
xgrammar releases the GIL while it compiles (measured: a Python loop on another thread
kept 96% of its speed), so a compile on a helper thread does not stall the engine's step.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from engine.structured_output.schema_check import check_json_schema
from scheduler.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

# Distinct specs kept; the least recently used is dropped past this (a compiled JSON
# schema holds its token-mask cache, ~100 KB to a few MB).
MAX_ENTRIES = 256
# "[16:35:08] /project/cpp/regex_converter.cc:83: " before each of xgrammar's messages.
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """The spec cannot be compiled; the message is the compiler's (or the schema check's)."""


@dataclass
class CompileResult:
    grammar: Any  # xgr.CompiledGrammar
    cache_hit: bool
    seconds: float  # time this call spent compiling (0 for a hit)


class GrammarCache:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        # xgrammar reads transformers' tokenizer class: a GGUF's own tokenizer
        # (engine/gguf_fast_tokenizer.py) gives that object over the same backend.
        if hasattr(tokenizer, "transformers_tokenizer"):
            tokenizer = tokenizer.transformers_tokenizer()
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        # One compile thread: on a small machine more would take cores from the step.
        # xgrammar's own cache is off: this one is the single cache, with hit counts.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1,
                                             cache_enabled=False)  # fmt: skip
        self._entries: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> CompileResult:
        """The compiled grammar; GrammarError when the spec cannot be compiled."""
        with self._lock:
            future = self._entries.get(spec)
            owner = future is None
            if owner:
                future = self._entries[spec] = Future()
                while len(self._entries) > MAX_ENTRIES:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(spec)
        if not owner:
            return CompileResult(future.result(), cache_hit=True, seconds=0.0)
        start = time.perf_counter()
        try:
            grammar = self._compile(spec)
        except Exception as exc:
            error = GrammarError(_compiler_message(exc))
            with self._lock:  # a failure is not kept: the next ask tries again
                if self._entries.get(spec) is future:
                    del self._entries[spec]
            future.set_exception(error)
            raise error from None
        future.set_result(grammar)
        seconds = time.perf_counter() - start
        logger.info("compiled a %s grammar (%d chars) in %.0f ms", spec.kind, len(spec.spec),
                    seconds * 1e3)  # fmt: skip
        return CompileResult(grammar, cache_hit=False, seconds=seconds)

    def _compile(self, spec: StructuredOutputs) -> Any:
        compiler = self._compiler
        if spec.kind == "json":
            check_json_schema(json.loads(spec.spec))
            # Compact separators: with free whitespace a small model can pad forever.
            return compiler.compile_json_schema(spec.spec, any_whitespace=False,
                                                strict_mode=spec.strict)  # fmt: skip
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)  # fmt: skip
        if spec.kind == "regex":
            return compiler.compile_regex(spec.spec)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(spec.spec)))
        if spec.kind == "structural_tag":
            tag = json.loads(spec.spec)
            for schema in embedded_schemas(tag):  # the same refusals as a lone schema's
                check_json_schema(schema)
            return compiler.compile_structural_tag(tag)
        return compiler.compile_grammar(spec.spec)


def embedded_schemas(node: Any) -> list[Any]:
    """The JSON schemas of a structural tag's `json_schema` formats (not looked inside:
    the tag's own nesting is shallow, a schema's is check_json_schema's to measure)."""
    if isinstance(node, list):
        return [s for item in node for s in embedded_schemas(item)]
    if not isinstance(node, dict):
        return []
    if node.get("type") == "json_schema":
        return [node.get("json_schema")]
    return [s for value in node.values() for s in embedded_schemas(value)]


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings": JSON string literals are EBNF's escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _compiler_message(exc: Exception) -> str:
    if isinstance(exc, ValueError):  # the schema check's, already worded for the client
        return str(exc)
    # Python's own words ("maximum recursion depth exceeded", "std::bad_alloc") tell the
    # client nothing about its spec; the checks before compiling should leave none of these.
    if isinstance(exc, RecursionError):
        return "is nested too deeply to compile"
    if isinstance(exc, MemoryError) or "bad_alloc" in str(exc):
        return "needs more memory to compile than this server gives one grammar"
    lines = [_LOCATION.sub("", line) for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__
