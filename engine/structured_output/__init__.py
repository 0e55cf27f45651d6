"""Structured outputs: JSON schemas, regexes, choices and EBNF grammars, enforced token by
token with xgrammar (the library vLLM and SGLang use) by masking each step's logits."""

from engine.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
