"""A request's sampling fields as the engine's `SamplingParams`, one per choice.

OpenAI's defaults fill what the request leaves out; `SamplingParams` itself checks the
values (a ValueError that names the field, which the server turns into a 400).
"""

from __future__ import annotations

from typing import Any

from engine import SamplingParams, StructuredOutputs, ThinkingBudget
from server.protocol import SamplingFields
from server.validation import parse_logit_bias

# Below this temperature sampling is numerically greedy anyway (vLLM does the same), and
# dividing the logits by it could overflow.
MIN_SAMPLING_TEMPERATURE = SamplingParams.GREEDY_TEMPERATURE


def to_sampling_params(
    req: SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    choice: int,
    vocab_size: int,
    structured: StructuredOutputs | None = None,
    thinking: ThinkingBudget | None = None,
) -> SamplingParams:
    """SamplingParams for choice `choice` of n; ValueError("<field> ...") when invalid."""
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": _temperature(req.temperature),
        "top_p": _default(req.top_p, 1.0),
        "top_k": req.top_k or 0,
        "min_p": req.min_p or 0.0,
        "seed": _seed(req.seed, choice),
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": _default(req.repetition_penalty, 1.0),
        # The keys as ids: the same parse check_common made, which is what converts them.
        "logit_bias": parse_logit_bias(req.logit_bias, vocab_size),
        "logprobs": logprobs,
        "min_tokens": req.min_tokens or 0,
        "stop": _stop_list(req.stop),
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": bool(req.ignore_eos),
        "include_stop_str_in_output": bool(req.include_stop_str_in_output),
        "skip_special_tokens": req.skip_special_tokens is not False,
        "structured_outputs": structured,
        "speculative": req.speculative is not False,
        "thinking_budget": thinking,
    }
    return SamplingParams(**fields)


def _seed(seed: int | None, choice: int) -> int | None:
    # n > 1 with a seed: distinct but reproducible sequences.
    return seed + choice if seed is not None and choice else seed


def _temperature(temperature: float | None) -> float:
    value = _default(temperature, 1.0)
    return 0.0 if 0.0 < value < MIN_SAMPLING_TEMPERATURE else value


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
