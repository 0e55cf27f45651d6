"""Every bad input gets its status and the OpenAI error shape; none gives a 500 or a hang."""

from __future__ import annotations

import pytest

from tests.engine.tiny_models import VOCAB_SIZE as VOCAB
from tests.server.conftest import TINY_MAX_MODEL_LEN, assert_openai_error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, VOCAB]}, "prompt"),
        ({"prompt": [-1, 2]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
        ({"stop": ["", "x"]}, "stop"),
        ({"stop_token_ids": [VOCAB + 1]}, "stop_token_ids"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"seed": 2**70}, "seed"),
        ({"top_k": 2**40}, "top_k"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"echo": "not-a-bool"}, "echo"),
    ],
)
def test_invalid_completion_values_are_400(server, body, param):
    response = server.http().post("/v1/completions", json={"prompt": "hi", **body})
    assert_openai_error(response, 400, param)


def test_prompt_beyond_context_names_both_numbers(server):
    response = server.http().post("/v1/completions", json={"prompt": [5] * 1000, "max_tokens": 100})
    error = assert_openai_error(response, 400, "prompt")
    assert str(TINY_MAX_MODEL_LEN) in error["message"] and "1100" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_prompt_alone_filling_the_context_is_400_for_chat_default_max_tokens(server):
    messages = [{"role": "user", "content": "word " * 1100}]
    response = server.http().post("/v1/chat/completions", json={"messages": messages})
    assert_openai_error(response, 400, "messages")


def test_nan_and_infinity_are_400(server):
    for value in (b"NaN", b"Infinity"):
        response = server.http().post(
            "/v1/completions",
            content=b'{"prompt": "hi", "temperature": ' + value + b"}",
            headers={"content-type": "application/json"},
        )
        assert_openai_error(response, 400, "temperature")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages.0.role"),
        ({"messages": [{"content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content.0"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"max_tokens": 5000}, "messages"),
    ],
)  # fmt: skip
def test_invalid_chat_values_are_400(server, body, param):
    fields = {"messages": [{"role": "user", "content": "hi"}], **body}
    response = server.http().post("/v1/chat/completions", json=fields)
    assert_openai_error(response, 400, param)


def test_unknown_model_is_404(server):
    for path, body in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        response = server.http().post(path, json={"model": "gpt-4", **body})
        error = assert_openai_error(response, 404, "model")
        assert error["code"] == "model_not_found" and "gpt-4" in error["message"]


def test_malformed_json_and_non_object_bodies_are_400(server):
    http = server.http()
    for content in (b'{"prompt": "hi",', b"not json", b'["a list"]', b""):
        response = http.post(
            "/v1/completions", content=content, headers={"content-type": "application/json"}
        )
        assert_openai_error(response, 400)
    assert_openai_error(http.post("/v1/completions", content=b"{bad"), 400)  # no content type


def test_missing_required_field_names_it(server):
    response = server.http().post("/v1/completions", json={"max_tokens": 3})
    error = assert_openai_error(response, 400, "prompt")
    assert "prompt" in error["message"]


def test_unknown_route_and_method_keep_the_error_shape(server):
    assert_openai_error(server.http().get("/v1/nothing-here"), 404)
    assert_openai_error(server.http().get("/v1/completions"), 405)


def test_detokenize_out_of_vocab_is_400(server):
    response = server.http().post("/detokenize", json={"tokens": [1, VOCAB + 5]})
    assert_openai_error(response, 400, "tokens")


def test_tokenize_needs_exactly_one_input(server):
    assert_openai_error(server.http().post("/tokenize", json={}), 400, "prompt")


def test_unknown_fields_are_ignored(server):
    response = server.http().post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1, "some_future_option": {"x": 1}, "user": "u1"},
    )
    assert response.status_code == 200, response.text


def test_server_is_healthy_and_clean_after_bad_inputs(server):
    assert server.http().get("/health").status_code == 200
    assert server.all_blocks_free()
