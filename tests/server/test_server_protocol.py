"""The request models, their validation and their conversion to SamplingParams (no engine)."""

from __future__ import annotations

import argparse

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from server.arg_types import parse_size
from server.chat_rendering import conversation
from server.cli import build_parser
from server.config_flags import engine_config_from_args
from server.errors import OpenAIError, from_value_error, validation_error
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from server.sampling_params import to_sampling_params
from server.validation import (
    check_chat_supported,
    check_common,
    check_completion_supported,
    check_context_length,
)

VOCAB = 1000
MAX_MODEL_LEN = 512


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(**{"prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **fields})


def raises_400(fn, param: str | None) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn()
    assert info.value.status_code == 400
    assert info.value.param == param
    return info.value


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a b", ["a b"]),
        (["a", "b"], ["a", "b"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt_list() == expected


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], [-1], [[1], []]])
def test_prompts_without_a_token_fail_validation(prompt):
    # Said by the model (so /openapi.json says it too), not found later by the tokenizer.
    with pytest.raises(ValidationError) as info:
        completion(prompt=prompt)
    assert {e["loc"][0] for e in info.value.errors()} == {"prompt"}


def test_mixed_prompt_list_is_a_validation_error():
    with pytest.raises(ValidationError):
        completion(prompt=[1, "a"])


def test_defaults_follow_openai():
    req = completion()
    params = to_sampling_params(req, req.max_tokens, None, 0, VOCAB)
    assert (params.max_tokens, params.temperature, params.top_p) == (16, 1.0, 1.0)
    assert params.logprobs is None and params.seed is None and params.stop == []


def test_all_fields_reach_sampling_params():
    req = completion(
        temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, seed=11, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={"5": 3.0}, stop="END",
        min_tokens=2, ignore_eos=True, stop_token_ids=[9], include_stop_str_in_output=True,
        skip_special_tokens=False,
    )  # fmt: skip
    p = to_sampling_params(req, 20, 3, 0, VOCAB)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 7, 0.1, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logit_bias == {5: 3.0} and p.stop == ["END"] and p.stop_token_ids == [9]
    assert p.min_tokens == 2 and p.ignore_eos and p.include_stop_str_in_output
    assert not p.skip_special_tokens and p.logprobs == 3 and p.max_tokens == 20


def test_n_choices_get_distinct_seeds():
    req = completion(n=3, seed=100)
    seeds = [to_sampling_params(req, 4, None, i, VOCAB).seed for i in range(3)]
    assert seeds == [100, 101, 102]


def test_temperature_zero_is_greedy_and_tiny_temperature_too():
    assert to_sampling_params(completion(temperature=0), 4, None, 0, VOCAB).greedy
    assert to_sampling_params(completion(temperature=1e-9), 4, None, 0, VOCAB).greedy


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_out_of_range_sampling_values_fail_validation_naming_their_field(fields, param):
    with pytest.raises(ValidationError) as info:
        completion(**fields)
    assert info.value.errors()[0]["loc"][0] == param


@pytest.mark.parametrize(
    "fields",
    [{"temperature": 0}, {"top_p": 1}, {"repetition_penalty": 0.01},
     {"repetition_penalty": 100}, {"presence_penalty": -2}, {"top_k": -1}],
)  # fmt: skip
def test_sampling_values_at_their_bounds_pass(fields):
    to_sampling_params(completion(**fields), 4, None, 0, VOCAB)


@pytest.mark.parametrize(
    ("field", "value"),
    [("stream", "yes"), ("stream", 1), ("echo", "true"), ("ignore_eos", 0),
     ("include_stop_str_in_output", "false"), ("skip_special_tokens", "no")],
)  # fmt: skip
def test_booleans_are_strict(field, value):
    with pytest.raises(ValidationError) as info:
        completion(**{field: value})
    assert info.value.errors()[0]["loc"] == (field,)


def test_chat_and_nested_booleans_are_strict():
    for make, fields in [
        (chat, {"logprobs": "yes"}),
        (chat, {"add_generation_prompt": 1}),
        (completion, {"stream": True, "stream_options": {"include_usage": "yes"}}),
    ]:
        with pytest.raises(ValidationError):
            make(**fields)


def test_integral_json_numbers_are_integers_but_strings_are_not():
    # JSON Schema calls 2.0 an integer; Python's json reads it as a float.
    req = completion(n=2.0, max_tokens=5.0, prompt=[1.0, 2.0], seed=7.0)
    assert (req.n, req.max_tokens, req.prompt, req.seed) == (2, 5, [1, 2], 7)
    assert isinstance(req.n, int)
    for fields in ({"n": 2.5}, {"n": "2"}, {"max_tokens": True}, {"prompt": [1.5]}):
        with pytest.raises(ValidationError):
            completion(**fields)


def test_max_tokens_below_one_names_max_tokens():
    with pytest.raises(ValueError) as info:
        to_sampling_params(completion(), 0, None, 0, VOCAB)
    assert from_value_error(info.value).param == "max_tokens"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"5000": 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        # int() reads all of these as token ids; none is plain decimal digits.
        ({"logit_bias": {"1_0": 1.0}}, "logit_bias"),
        ({"logit_bias": {" 7": 1.0}}, "logit_bias"),
        ({"logit_bias": {"+7": 1.0}}, "logit_bias"),
        ({"logit_bias": {"\u0663": 1.0}}, "logit_bias"),  # ARABIC-INDIC DIGIT THREE
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ],
)
def test_common_checks(fields, param):
    raises_400(lambda: check_common(completion(**fields), VOCAB, MAX_MODEL_LEN), param)


def test_logit_bias_keys_are_plain_decimal_token_ids():
    req = completion(logit_bias={"10": 1.0, "007": -1.0, "0": 2.0})
    check_common(req, VOCAB, MAX_MODEL_LEN)
    assert to_sampling_params(req, 4, None, 0, VOCAB).logit_bias == {10: 1.0, 7: -1.0, 0: 2.0}


def test_chat_max_completion_tokens_is_named_in_its_errors():
    with pytest.raises(ValidationError) as info:
        chat(max_completion_tokens=-5)
    assert info.value.errors()[0]["loc"] == ("max_completion_tokens",)
    too_long = chat(max_completion_tokens=MAX_MODEL_LEN)
    raises_400(lambda: check_common(too_long, VOCAB, MAX_MODEL_LEN), "max_completion_tokens")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"structural_tag": "{}"}, "structural_tag"),
    ],
)
def test_unsupported_completion_fields_are_400(fields, param):
    raises_400(lambda: check_completion_supported(completion(**fields)), param)


def test_harmless_values_of_unsupported_fields_pass():
    check_completion_supported(completion(suffix=None, best_of=2, n=2, prompt_logprobs=None))


def test_unknown_fields_are_reported_not_rejected():
    req = completion(some_future_field=1, another=True)
    check_completion_supported(req)
    assert req.unknown_fields() == ["another", "some_future_field"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "g"}},
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_unsupported_chat_fields_are_400(fields, param):
    raises_400(lambda: check_chat_supported(chat(**fields)), param)


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"tool_choice": "sometimes"}, ("tool_choice", "literal['none','auto','required']")),
        ({"response_format": {"type": "json_schema", "json_schema": {}}},
         ("response_format", "json_schema", "name")),
        ({"response_format": {"type": "xml"}}, ("response_format", "type")),
        ({"modalities": ["text", "audio"]}, ("modalities", 1)),
        ({"messages": [{"role": "function", "content": "x"}]}, ("messages", 0, "role")),
        ({"messages": [{"role": "", "content": "x"}]}, ("messages", 0, "role")),
    ],
)  # fmt: skip
def test_chat_values_this_server_cannot_honour_fail_validation(fields, loc):
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    assert info.value.errors()[0]["loc"] == loc


def test_chat_text_response_format_and_tool_choice_none_pass():
    check_chat_supported(chat(response_format={"type": "text"}, tool_choice="none", tools=[]))


def test_chat_conversation_normalises_roles_and_parts():
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert conversation(req.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]


def test_a_tool_result_without_a_name_gets_the_name_of_the_call_it_answers():
    """Hermes' and Qwen2.5's templates refuse a tool message without `name`, which OpenAI's
    tool messages never carry."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    req = chat(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_9", "content": "answers no call"},
        {"role": "tool", "tool_call_id": "call_1", "name": "own", "content": "named"},
    ])  # fmt: skip
    names = [m.get("name") for m in conversation(req.messages)]
    assert names == [None, None, "get_weather", None, "own"]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
         "messages.0.content.0"),
        ({"role": "user", "content": None}, "messages.0.content"),
        ({"role": "assistant", "content": "x", "function_call": {"name": "f"}},
         "messages.0.function_call"),
    ],
)  # fmt: skip
def test_bad_messages_are_400(message, param):
    raises_400(lambda: conversation(chat(messages=[message]).messages), param)


def test_chat_max_completion_tokens_wins_and_logprobs_count():
    req = chat(max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=3)
    assert req.requested_max_tokens() == 7 and req.num_logprobs() == 3
    assert chat(logprobs=True).num_logprobs() == 0 and chat().num_logprobs() is None


@pytest.mark.parametrize(
    "fields",
    [{"n": 0}, {"n": 1000}, {"logprobs": 21}, {"logprobs": -1}, {"seed": 2**64},
     {"top_k": 2**40}],
)  # fmt: skip
def test_out_of_range_fields_fail_validation(fields):
    with pytest.raises(ValidationError):
        completion(**fields)


def test_context_length_error_names_both_numbers():
    err = raises_400(lambda: check_context_length(1000, 100, 1024, "prompt"), "prompt")
    assert "1024" in err.message and "1100" in err.message and err.code == "context_length_exceeded"
    check_context_length(1000, 24, 1024, "prompt")


def test_validation_error_becomes_openai_shape_with_param():
    try:
        chat(messages=[{"role": "user", "content": 5}])
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    err = validation_error(RequestValidationError(errors))
    assert err.status_code == 400 and err.param.startswith("messages.0.content")
    assert "messages.0.content" in err.message


@pytest.mark.parametrize(
    ("text", "expected"),
    [("123", 123), ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
     ("2G", 2 << 30), ("64k", 64 << 10)],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "2XB", "-5", "GiB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_cli_engine_flags_map_to_engine_config():
    args = build_parser().parse_args(
        ["serve", "--model", "/m", "--dtype", "float32", "--device", "cpu", "--block-size", "32",
         "--kv-cache-memory", "1GiB", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
         "--max-model-len", "256", "--no-prefix-caching", "--prefix-cache-hash", "sha256",
         "--seed", "3", "--port", "9000", "--api-key", "k", "--max-waiting-requests", "4",
         "--quantization", "int8", "--scheduling-policy", "lpm", "--age-bound", "2.5", "--queue-timeout", "3",
         "--kv-cache-dtype", "int8"]
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert config.quantization == "int8"
    assert (config.scheduling_policy, config.age_bound_s) == ("lpm", 2.5)
    assert config.kv_cache_dtype == "int8"
    assert (config.model, config.dtype, config.device, config.block_size) == (
        "/m",
        "float32",
        "cpu",
        32,
    )
    assert config.kv_cache_memory == 1 << 30 and config.num_blocks is None
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len) == (
        8,
        512,
        256,
    )
    assert not config.enable_prefix_caching and config.prefix_cache_hash == "sha256"
    assert config.seed == 3 and args.port == 9000 and args.host == "127.0.0.1"
    assert args.api_key == "k" and args.max_waiting_requests == 4
    assert args.queue_timeout == 3.0
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--queue-timeout", bad])


def test_cli_defaults_leave_engine_config_defaults():
    from engine import EngineConfig

    args = build_parser().parse_args(["serve"])
    assert engine_config_from_args(args) == EngineConfig()


def test_cli_kv_memory_and_num_blocks_are_exclusive():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--num-blocks", "4", "--kv-cache-memory", "1GiB"])


def test_cli_max_seqs_per_request():
    assert build_parser().parse_args(["serve"]).max_seqs_per_request == 256
    args = build_parser().parse_args(["serve", "--max-seqs-per-request", "4"])
    assert args.max_seqs_per_request == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-seqs-per-request", "0"])


def test_validation_error_prefers_the_member_whose_type_the_value_has():
    def error_for(**fields):
        try:
            completion(**fields)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        return validation_error(RequestValidationError(errors))

    empty = error_for(prompt="")
    assert empty.param == "prompt" and "at least 1 character" in empty.message
    mixed = error_for(prompt=[1, "a"])
    assert mixed.param == "prompt"
    assert "expected one of str, list[str], list[int], list[list[int]]" in mixed.message
