"""Structured outputs on the default model: every output has the shape it was asked for.

The grammar is what makes these pass (a 135M model does not reliably write valid JSON,
let alone to a schema, on its own); each schema bounds its strings, arrays and numbers,
so a completed output is reached well within max_tokens and `finish_reason` is "stop".
"""

from __future__ import annotations

import gc
import json
import re
import threading
import weakref

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputs
from engine.sampler import Sampler, SamplingMetadata
from engine.structured_output import bitmask as bitmask_module
from engine.structured_output.bitmask import GrammarBitmask
from engine.structured_output.grammar_cache import GrammarCache, GrammarError
from engine.structured_output.schema_check import check_json_schema
from tests.engine.tiny_models import VOCAB_SIZE, default_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "doctor", "teacher"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 2,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
MEASUREMENTS = {
    "type": "object",
    "properties": {
        "readings": {
            "type": "array",
            "items": {"type": "integer", "minimum": -40, "maximum": 60},
            "minItems": 3,
            "maxItems": 5,
        },
        "unit": {"const": "celsius"},
        "humidity": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"},
    },
    "required": ["readings", "unit", "humidity", "ok"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "measurements": MEASUREMENTS}
PROMPT = [{"role": "user", "content": "Describe a person as JSON."}]
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.9, "seed": 7}


def copies(knobs: dict, n: int) -> int:
    """Requests per batch: n seeded samples differ, n greedy copies of one prompt would be
    one answer n times (the suite's time; sampled batches check the masks side by side)."""
    return n if knobs is SAMPLED else 1


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu", num_blocks=256, max_model_len=1024, seed=0)


def chat(llm: LLM, spec: StructuredOutputs, n: int = 1, max_tokens: int = 200, **knobs):
    """n requests in one batch; sampled ones with seeds seed, seed + 1, ... so they differ."""
    seed = knobs.pop("seed", None)
    params = [
        SamplingParams(max_tokens=max_tokens, structured_outputs=spec,
                       seed=None if seed is None else seed + i, **knobs)
        for i in range(n)
    ]  # fmt: skip
    return llm.chat([PROMPT] * n, params, use_tqdm=False)


@pytest.fixture(scope="module")
def person_greedy(llm: LLM) -> list:
    """The greedy answer to PERSON's schema, which two tests read: one request (7-9 s of
    generation on a 2-core Zen 3), not the same request twice."""
    return chat(llm, StructuredOutputs.json_schema(PERSON), n=copies(GREEDY, 3), **GREEDY)


@pytest.mark.parametrize("knobs", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(llm, name, knobs, request):
    schema = SCHEMAS[name]
    if schema is PERSON and knobs is GREEDY:
        outputs = request.getfixturevalue("person_greedy")
    else:
        outputs = chat(llm, StructuredOutputs.json_schema(schema), n=copies(knobs, 3), **knobs)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_schema_properties_come_in_the_schema_order(person_greedy):
    (out,) = person_greedy
    assert list(json.loads(out.text)) == list(PERSON["properties"])


@pytest.mark.parametrize("knobs", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_object_outputs_parse_as_objects(llm, knobs):
    spec = StructuredOutputs("json_object")
    prompt = [{"role": "user", "content": 'Reply with the JSON object {"answer": 42}.'}]
    params = SamplingParams(max_tokens=100, structured_outputs=spec, **knobs)
    (out,) = llm.chat([prompt], [params], use_tqdm=False)
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("knobs", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_regex_outputs_fullmatch(llm, knobs):
    pattern = r"[A-Z][a-z]{2,8} (19|20)[0-9]{2}-(0[1-9]|1[0-2])"
    for out in chat(llm, StructuredOutputs("regex", pattern), n=copies(knobs, 3), **knobs):
        assert re.fullmatch(pattern, out.text), out.text


@pytest.mark.parametrize("knobs", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_choice_outputs_are_one_of_the_choices(llm, knobs):
    choices = ["positive", "negative", 'neutral "maybe"', "café\n"]
    for out in chat(llm, StructuredOutputs.choices(choices), n=copies(knobs, 4), **knobs):
        assert out.text in choices, out.text
        assert out.finish_reason == "stop"


@pytest.mark.parametrize("knobs", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_ebnf_grammar_is_honoured(llm, knobs):
    grammar = r"""
root ::= "Answer: " verdict " (" digit digit "%)"
verdict ::= "yes" | "no"
digit ::= [0-9]
"""
    for out in chat(llm, StructuredOutputs("grammar", grammar), n=3, **knobs):
        assert re.fullmatch(r"Answer: (yes|no) \([0-9]{2}%\)", out.text), out.text


def test_a_complete_grammar_ends_the_request_even_when_eos_is_ignored(llm):
    spec = StructuredOutputs.choices(["yes", "no"])
    (out,) = chat(llm, spec, max_tokens=50, ignore_eos=True, **GREEDY)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert len(out.token_ids) < 50


def test_mixed_batch_under_preemption_keeps_grammars_and_reference_tokens():
    """A KV pool too small for the batch: requests are preempted and recomputed, and the
    constrained ones still validate while the unconstrained ones equal their tokens run
    alone with ample memory."""
    prompts = [[{"role": "user", "content": f"Tell me fact number {i} about the sea."}]
               for i in range(4)]  # fmt: skip
    free = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    reference = LLM(dtype="float32", device="cpu", num_blocks=256, seed=0)
    expected = [o.token_ids for o in reference.chat(prompts, free, use_tqdm=False)]

    small = LLM(dtype="float32", device="cpu", num_blocks=24, block_size=16, seed=0)
    spec = StructuredOutputs.json_schema(MEASUREMENTS)
    constrained = [SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=spec),
                   SamplingParams(max_tokens=120, temperature=0.9, seed=3,
                                  structured_outputs=spec)]  # fmt: skip
    outputs = small.chat(prompts + prompts[:2], [free] * 4 + constrained, use_tqdm=False)

    assert small.engine.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs[:4]] == expected
    for out in outputs[4:]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), MEASUREMENTS)
    assert not small.engine.core.scheduler.requests  # every request, with its matcher, released
    kv = small.engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_releases_the_matcher(llm):
    engine = llm.engine
    spec = StructuredOutputs.json_schema(PERSON)
    engine.add_request("aborted", [1, 2, 3], SamplingParams(max_tokens=5, structured_outputs=spec))
    # The request holds its matcher (Request.grammar); nothing else may keep it alive.
    matcher = weakref.ref(engine.core.scheduler.requests["aborted"].grammar)
    assert matcher() is not None
    engine.step()
    engine.abort_request(["aborted"])
    gc.collect()
    assert matcher() is None


def test_an_uncompilable_spec_is_refused_before_the_request_is_queued(llm):
    engine = llm.engine
    with pytest.raises(GrammarError, match="parenthesis"):
        engine.add_request("bad", [1, 2], SamplingParams(
            structured_outputs=StructuredOutputs("regex", "a(b")))  # fmt: skip
    assert not engine.has_unfinished_requests()


# ----------------------------------------------------------------- the pieces alone


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [
        ({"type": "string", "not": {"const": "x"}}, "`not` is not supported (at #/not)"),
        ({"properties": {"a": {"if": {}, "then": {}}}}, "(at #/properties/a/if)"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "`allOf` with more than one"),
        ({"items": {"$ref": "https://example.com/s.json"}}, "only local `$ref`s"),
        ({"type": "array", "minItems": -1}, "not a valid JSON Schema"),
        ({"type": "nonsense"}, "not a valid JSON Schema"),
        ([1, 2], "must be an object"),
    ],
)
def test_schema_check_refuses_what_would_be_silently_wrong(schema, fragment):
    with pytest.raises(ValueError) as info:
        check_json_schema(schema)
    assert fragment in str(info.value)


def test_schema_check_follows_schemas_not_property_names():
    check_json_schema({"type": "object", "properties": {"not": {"type": "string"},
                                                        "if": {"enum": [1]}}})  # fmt: skip
    check_json_schema({"allOf": [{"type": "integer"}], "$defs": {"a": {"type": "string"}},
                       "items": {"$ref": "#/$defs/a"}})  # fmt: skip


# Schemas no JSON value matches, because their $refs never reach one without a $ref. The
# third made xgrammar 0.2.8 allocate until the process was killed: never compile it here.
REF_LOOPS = [
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#/$ref"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "#/$ref"),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
     "#/properties/x/$ref"),
    ({"type": "object", "properties": {"x": {"$ref": "#/"}}, "required": ["x"]},
     "#/properties/x/$ref"),  # "#/" is the root to xgrammar
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#/items/$ref"),
    ({"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}, "#/anyOf/0/$ref"),
    # Optional, yet a property that could be started and never finished.
    ({"properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"$ref": "#/$defs/a"}}},
     "#/properties/x/$ref"),
]  # fmt: skip
RECURSIVE_WITH_A_WAY_OUT = [
    {"type": "object", "properties": {"v": {"type": "integer"},
                                      "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
    {"$defs": {"node": {"type": "object", "required": ["v", "next"], "properties": {
        "v": {"type": "integer"},
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
     "$ref": "#/$defs/node"},
    {"type": "object", "properties": {"x": {"$ref": "#"}}},  # optional
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"$ref": "#"},
     "minItems": 1},
    {"$ref": "#/$defs/missing"},  # the compiler's to refuse
]  # fmt: skip


@pytest.mark.parametrize(("schema", "where"), REF_LOOPS)
def test_schema_check_refuses_refs_that_never_end(schema, where):
    with pytest.raises(ValueError, match="describes no JSON value") as info:
        check_json_schema(schema)
    assert f"(at {where})" in str(info.value)


@pytest.mark.parametrize("schema", RECURSIVE_WITH_A_WAY_OUT)
def test_schema_check_keeps_recursive_schemas_with_a_way_out(schema):
    check_json_schema(schema)


@pytest.mark.parametrize("schema", [False, {"properties": {"a": False}, "required": ["a"]}])
def test_schema_check_refuses_a_schema_nothing_matches(schema):
    with pytest.raises(ValueError, match="describes no JSON value"):
        check_json_schema(schema)


def items_schema(levels: int) -> dict:
    """Arrays of arrays: `levels` JSON objects one inside another."""
    schema: dict = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("levels", [65, 500, 5000])
def test_schema_check_measures_depth_without_recursion(levels):
    with pytest.raises(ValueError, match="nested more than 64 levels deep") as info:
        check_json_schema(items_schema(levels))
    assert "recursion" not in str(info.value)


def test_schema_check_takes_a_schema_at_the_depth_limit():
    check_json_schema(items_schema(64))


def test_compile_errors_never_carry_pythons_own_words(grammars, monkeypatch):
    def recurse(*_: object, **__: object) -> None:
        raise RecursionError("maximum recursion depth exceeded in comparison")

    monkeypatch.setattr(grammars._compiler, "compile_regex", recurse)
    with pytest.raises(GrammarError) as info:
        grammars.compile(StructuredOutputs("regex", "never-compiled-before"))
    assert "recursion" not in str(info.value) and "nested too deeply" in str(info.value)


@pytest.fixture(scope="module")
def grammars() -> GrammarCache:
    return GrammarCache(default_tokenizer(), VOCAB_SIZE, [2])


def test_each_spec_compiles_once_and_failures_are_not_kept(grammars):
    spec = StructuredOutputs.json_schema(
        {"type": "object", "properties": {"q": {"type": "integer"}}}
    )
    first, second = grammars.compile(spec), grammars.compile(spec)
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert second.grammar is first.grammar and second.seconds == 0.0
    bad = StructuredOutputs("grammar", "root ::= undefined_rule")
    for _ in range(2):
        with pytest.raises(GrammarError, match="undefined_rule"):
            grammars.compile(bad)


def test_threads_asking_for_one_spec_share_one_compilation(grammars):
    spec = StructuredOutputs("regex", "[a-z]{3,9}@example\\.(com|org)")
    results = []
    threads = [threading.Thread(target=lambda: results.append(grammars.compile(spec)))
               for _ in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.cache_hit for r in results) == [False, True, True, True]
    assert len({id(r.grammar) for r in results}) == 1


def test_the_mask_touches_only_constrained_rows():
    vocab = 100
    logits = torch.randn(3, vocab)
    bitmask = torch.zeros(3, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[1, 0] = 1 << 5  # row 1 may only write token 5; rows 0 and 2 hold garbage
    bitmask[0].fill_(0)
    params = [SamplingParams(temperature=0.0)] * 3
    meta = SamplingMetadata.build(params, [[1]] * 3, [[]] * 3, [None] * 3, [frozenset()] * 3,
                                  "cpu", grammar=GrammarBitmask(bitmask, [1]))  # fmt: skip
    processed = Sampler.process_logits(logits, meta)
    assert torch.equal(processed[0], logits[0]) and torch.equal(processed[2], logits[2])
    assert processed[1].argmax() == 5 and torch.isinf(processed[1]).sum() == vocab - 1
    tokens = Sampler()(logits, meta).token_ids.tolist()
    assert tokens == [int(logits[0].argmax()), 5, int(logits[2].argmax())]


@pytest.mark.parametrize("native", [True, False], ids=["kernels-where-built", "xgrammar"])
@pytest.mark.parametrize("vocab", [49152, 49157, 70])
def test_the_mask_forbids_exactly_the_zero_bits(monkeypatch, native, vocab):
    """The AVX-512 kernel (where the CPU kernels build) and xgrammar's own apply agree with
    the bits, partial last word included, and leave the other rows alone."""
    if not native:
        monkeypatch.setattr(bitmask_module, "host_kernels", lambda device: None)
    generator = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32, generator=generator)
    logits = torch.randn(4, vocab, generator=generator)
    masked = logits.clone()
    GrammarBitmask(bits, [0, 2]).apply_(masked)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(4, -1)[:, :vocab]
    for row in (0, 2):
        expected = logits[row].masked_fill(~allowed[row], float("-inf"))
        assert torch.equal(masked[row], expected)
    assert torch.equal(masked[1], logits[1]) and torch.equal(masked[3], logits[3])


def test_text_held_back_for_a_stop_string_is_kept_when_the_grammar_ends_the_request(llm):
    """With eos ignored the grammar, not eos, ends the request: text the detokenizer held
    back (it could have begun a stop string) is the output's end and must not be lost."""
    spec = StructuredOutputs.choices(["yes", "no"])
    stop = ["yes, surely", "no, surely"]
    (out,) = chat(llm, spec, max_tokens=50, ignore_eos=True, stop=stop, **GREEDY)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
