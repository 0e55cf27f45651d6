"""bench.structured's inputs: the schemas it times must compile and must do what it says."""

from __future__ import annotations

import xgrammar as xgr

from bench.structured import BOUNDED_LIST, LONG_LIST, large_schema
from engine import StructuredOutputs
from engine.structured_output.grammar_cache import GrammarCache
from tests.engine.tiny_models import VOCAB_SIZE, default_tokenizer


def test_the_timed_lists_compile_and_outlast_the_timed_steps():
    cache = GrammarCache(default_tokenizer(), VOCAB_SIZE, [2])
    for schema in (LONG_LIST, BOUNDED_LIST):
        matcher = xgr.GrammarMatcher(cache.compile(StructuredOutputs.json_schema(schema)).grammar)
        # 63 items written: the array is not complete yet, so no request ends early.
        assert matcher.accept_string('{"fruits": [' + ", ".join(['"a"'] * 63))
        assert not matcher.accept_string("]")


def test_large_schemas_are_distinct_cache_misses_that_compile():
    cache = GrammarCache(default_tokenizer(), VOCAB_SIZE, [2])
    a, b = (StructuredOutputs.json_schema(large_schema(tag)) for tag in ("a", "b"))
    assert a != b
    assert not cache.compile(a).cache_hit and not cache.compile(b).cache_hit
