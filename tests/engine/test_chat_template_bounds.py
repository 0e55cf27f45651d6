"""A model's chat template is its file's code (issue 64): every render is bounded in time,
in the prompt's size, in the size of any value and in the memory it allocates, and the
template is rendered once at load under the same bounds.

Each bad template ends in one of: served, a clear error in bounded time, or a one-line
refusal at load; never a dead process, a hang or a traceback, and the process's memory
comes back. The server's side (threads, 400/500, several models) is
tests/server/test_server_chat_template_bounds.py.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.chat_template_check import (
    PROBES,
    bytes_per_token,
    chat_template_limits,
    check_chat_template,
)
from engine.errors import ModelFileError
from engine.gguf_chat_template import compile_template, render_chat
from engine.gguf_file import GGUFFile
from engine.loader import convert_gguf, default_gguf_path, load_tokenizer
from engine.template_bounds import RenderLimits, TemplateBoundError
from engine.template_filters import LEFT_OUT, PREDICTORS, PROPORTIONAL
from tests.engine.gguf_models import write_with_chat_template
from tests.engine.tiny_models import default_tokenizer

# The default model's bounds (8,192 tokens of at most 81 bytes), with a short time bound.
LIMITS = RenderLimits(timeout_s=0.5, max_prompt_bytes=8192 * 81)
RECURSION_LIMITS = RenderLimits(timeout_s=5.0, max_prompt_bytes=8192 * 81)
SLACK_S = 1.5  # a bound is noticed at the next check: a loop turn, a call, a chunk
CHAT = [{"role": "user", "content": "Hello"}]
NESTED = "{{ " + "(" * 10_000 + "1" + ")" * 10_000 + " }}"

# name -> (template, what it ends in: a bound of engine/template_bounds.py, or jinja's error)
BAD_TEMPLATES = {
    # the six: two are served errors already, four killed or hung the server
    "attribute access to Python's internals": ("{{ messages.__class__.__mro__ }}",
                                               "SecurityError"),
    "a macro calling itself": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
    "a syntax error": ("{% for %}", "TemplateSyntaxError"),
    "raise_exception": ("{{ raise_exception('no system role') }}", "TemplateError"),
    "two nested loops of 100,000": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "time"),
    "'x' * 10**10": ("{{ 'x' * 10000000000 }}", "value size"),
    "a 10,000 x 10,000-character join": (
        "{% set s = 'x' * 10000 %}{{ ([s] * 10000) | join }}", "value size"),
    "100,000 prints of 100,000 characters": (
        "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "prompt size"),
    # and more of the same kind
    "range(10**9)": ("{% for i in range(10**9) %}{% endfor %}", "value size"),
    "'x' | center(10**10)": ("{{ 'x' | center(10**10) }}", "value size"),
    "a {% set %} list built by + in a loop": (
        "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
        "{% set ns.l = ns.l + ['y' * 100000] %}{% endfor %}{{ ns.l | length }}", "memory"),
    "2**40 macro calls": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(40) }}", "time"),
    "a string doubled in a loop": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}", "value size"),
    "an integer squared in a loop": (
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}", "value size"),
    "a list of 100,000 copies written out": (
        "{% set s = 'x' * 100000 %}{{ [s] * 100000 }}", "value size"),
    "tojson of 100,000 copies": ("{% set s = 'x' * 100000 %}{{ ([s] * 100000) | tojson }}",
                                 "value size"),
    "str.join of 10,000 copies": ("{% set s = 'x' * 10000 %}{{ ''.join([s] * 10000) }}",
                                  "value size"),
    "a printf width": ("{{ '%100000000000s' | format('x') }}", "value size"),
    "a str.format width": ("{{ '{:>100000000000}'.format('x') }}", "value size"),
    "indent by 10**10": ("{{ 'a\nb' | indent(10**10) }}", "value size"),
    "wordwrap with a long wrapstring": (
        "{{ ('x ' * 300000) | wordwrap(1, wrapstring='y' * 1000) }}", "value size"),
    "replace '' by a long string": ("{{ ('x' * 100000).replace('', 'y' * 100) }}", "value size"),
    "batch(10**9) padded": ("{{ [1] | batch(10**9, 0) | list }}", "value size"),
    "a sum of 600,000 lists": ("{{ ([[1]] * 600000) | sum(start=[]) | length }}", "memory"),
    "tojson indented by 10**9": ("{{ messages | tojson(indent=10**9) }}", "value size"),
    "an escaped string's replace": ("{{ (('x' * 100000) | safe).replace('', 'y' * 100) }}",
                                    "value size"),
    "1, 10,000 parentheses deep": (NESTED, "recursion"),
}  # fmt: skip


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _outcome(template: str, limits: RenderLimits = LIMITS) -> str:
    try:
        render_chat(template, CHAT, {"bos_token": "<s>"}, limits=limits)
    except TemplateBoundError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("the chat template ")
        return exc.bound
    except jinja2.TemplateError as exc:
        return type(exc).__name__
    return "served"


@pytest.mark.parametrize("name", BAD_TEMPLATES)
def test_a_bad_template_ends_in_a_clear_error_in_bounded_time_and_memory_comes_back(name):
    template, expected = BAD_TEMPLATES[name]
    # A recursion reaches Python's stack limit in about 0.25 s here, half the time limit:
    # on a loaded machine the time bound could end it first, so it gets more time.
    limits = RECURSION_LIMITS if expected == "recursion" else LIMITS
    gc.collect(1)  # (the render's garbage is young; a full collection takes ~0.5 s here)
    before = _rss_mib()
    start = time.monotonic()
    assert _outcome(template, limits) == expected
    assert time.monotonic() - start < limits.timeout_s + SLACK_S
    gc.collect(1)  # (the render's garbage is young; a full collection takes ~0.5 s here)
    assert _rss_mib() < before * 1.1, f"RSS {before:.0f} -> {_rss_mib():.0f} MiB"


def test_the_bounds_do_not_stop_real_templates_rendering_what_they_rendered():
    # A plain immutable sandbox (what rendered templates before) and the bounded one give
    # the same text: the default model's template, and one with tools, loops and filters.
    tools = ("{% for m in messages %}{% if loop.first and tools %}{{ tools | tojson }}"
             "{% endif %}{{ '<|' + m['role'] + '|>' + m['content'] | trim }}{% if m.tool_calls %}"
             "{% for c in m.tool_calls %}{{ c.function.name ~ '(' ~ c.function.arguments | tojson"
             " ~ ')' }}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{{ messages[1:] | length }}"
             "{{ (messages | map(attribute='role') | join(', ')).center(40, '-') }}"
             "{{ '%s=%d' % ('n', messages | length) }}{{ range(3) | list }}")  # fmt: skip
    messages, probe_tools = PROBES["tools, a call and its result"]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    for source in (default_tokenizer().chat_template, tools):
        expected = plain.from_string(source).render(
            messages=messages, tools=probe_tools, add_generation_prompt=True, bos_token="<s>"
        )
        assert render_chat(source, messages, {"bos_token": "<s>"}, probe_tools, None, True,
                           limits=LIMITS) == expected  # fmt: skip


def test_every_filter_is_bounded_by_its_input_or_predicted():
    # A jinja upgrade's new filter must be classified before it is served.
    env = compile_template("x").environment
    filters = set(env.filters) - {"_bounded_loop"}
    assert filters == set(PREDICTORS) | PROPORTIONAL
    assert not set(LEFT_OUT) & filters and "lipsum" not in env.globals


def test_the_prompt_bound_is_the_context_in_the_vocabularys_longest_tokens():
    tokenizer = default_tokenizer()
    assert bytes_per_token(tokenizer) == 81  # SmolLM2's longest token: a newline, 80 spaces
    limits = chat_template_limits(tokenizer, 2048, 1.5)
    assert (limits.timeout_s, limits.max_prompt_bytes) == (1.5, 2048 * 81)
    # a message the context could take renders; one it could not is refused as it renders
    fits = [{"role": "user", "content": " " * 2048 * 40}]
    assert len(render_chat(tokenizer.chat_template, fits, {}, limits=limits)) > 2048 * 40
    too_long = [{"role": "user", "content": "x" * 2048 * 81}]
    with pytest.raises(TemplateBoundError) as refused:
        render_chat(tokenizer.chat_template, too_long, {}, limits=limits)
    assert refused.value.bound == "prompt size"


# -- the check at load: crafted copies of the default GGUF ---------------------------------

# What a template gets at load: "served", or the refusal line's words.
AT_LOAD = {
    "two nested loops of 100,000": "ran for more than its 0.5 s time bound",
    "'x' * 10**10": "would build a repeated value of 10,000,000,000 items",
    "a 10,000 x 10,000-character join": "would build a string of",
    "100,000 prints of 100,000 characters": "rendered a prompt of more than",
    "a {% set %} list built by + in a loop": "allocated more than its memory bound",
    "a macro calling itself": "recursed past Python's stack limit",
    "a syntax error": "its chat template does not compile: Expected an expression",
    "attribute access to Python's internals": "its chat template reaches for Python's internals",
    "raise_exception": "served",
}


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> dict[str, Path]:
    """The default model's GGUF with each template of AT_LOAD (and a real one that refuses
    system messages) as its chat template; their weights are never read (a hole)."""
    root = tmp_path_factory.mktemp("crafted")
    system_refused = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
                      "not supported') }}{% endif %}" + default_tokenizer().chat_template)  # fmt: skip
    templates = {name: BAD_TEMPLATES[name][0] for name in AT_LOAD}
    templates["refuses a system message"] = system_refused
    return {name: write_with_chat_template(root / f"{i}.gguf", template, weights=False)
            for i, (name, template) in enumerate(templates.items())}  # fmt: skip


def test_a_crafted_file_holds_the_template_and_every_weight_as_it_was(tmp_path):
    path = write_with_chat_template(tmp_path / "m.gguf", BAD_TEMPLATES["raise_exception"][0])
    ours, theirs = GGUFFile(path), GGUFFile(default_gguf_path())
    assert ours.metadata["tokenizer.chat_template"] == BAD_TEMPLATES["raise_exception"][0]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.type, a.shape) == (b.name, b.type, b.shape)
    for i in (0, len(ours.tensors) // 2, -1):
        assert bytes(ours.array(ours.tensors[i])) == bytes(theirs.array(theirs.tensors[i]))


@pytest.mark.parametrize("name", [*AT_LOAD, "refuses a system message"])
def test_a_template_failing_its_bounds_at_load_is_one_line_refusing_the_model(
    crafted, tmp_path, name
):
    path = crafted[name]
    tokenizer = load_tokenizer(convert_gguf(path, tmp_path / "cache"))
    limits = RenderLimits(0.5, 8192 * bytes_per_token(tokenizer))
    start = time.monotonic()
    expected = AT_LOAD.get(name, "served")
    if expected == "served":
        check_chat_template(tokenizer, limits, path)
    else:
        with pytest.raises(ModelFileError, match=expected) as refused:
            check_chat_template(tokenizer, limits, path)
        line = str(refused.value)
        assert line.startswith(f"{path}: ") and "\n" not in line
    assert time.monotonic() - start < len(PROBES) * (limits.timeout_s + SLACK_S)


def test_the_engine_refuses_such_a_model_before_reading_its_weights(crafted, tmp_path):
    from engine import LLM

    path = crafted["two nested loops of 100,000"]
    start = time.monotonic()
    with pytest.raises(ModelFileError, match=r"0\.25 s time bound rendering a probe chat"):
        LLM(model=str(path), dtype="float32", cache_dir=str(tmp_path / "cache"),
            chat_template_timeout=0.25)  # fmt: skip
    assert time.monotonic() - start < 30
