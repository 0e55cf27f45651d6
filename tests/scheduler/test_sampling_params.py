"""SamplingParams.verify: every invalid option is a ValueError that starts with its field."""

from __future__ import annotations

import math

import pytest

from scheduler.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        # Finite and > 0, yet 0 in float32: the sampler would divide logits by zero.
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_non_finite_and_extreme_values_name_their_field(fields, name):
    with pytest.raises(ValueError, match=f"^{name} "):
        SamplingParams(**fields)


def test_repetition_penalty_bounds_are_accepted():
    low, high = SamplingParams.REPETITION_PENALTY_RANGE
    assert (low, high) == (0.01, 100.0)
    SamplingParams(repetition_penalty=low)
    SamplingParams(repetition_penalty=high)


def test_empty_stop_string_message_names_stop_once():
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=["x", ""])
    assert str(info.value) == "stop strings must be non-empty"
