"""Speculation under a grammar: structured answers with `--speculative ngram` on and off.

    .venv/bin/python -m bench.spec_grammar [--rounds 3] [--requests 4]

The default model (its GGUF, the serving config) answers chat requests constrained by a
tool-call-like JSON schema (long keys and enum values: text the grammar forces, which the
speculator drafts), one request at a time, greedy; offline engines with speculation off
and on, in turns. Prints output tok/s per round, the median ratio on / off, and the drafts
kept. The outputs must be the same tokens on and off (checked).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.machine import machine_line

SCHEMA = {
    "type": "object",
    "properties": {
        "function_name": {"enum": ["search_knowledge_base", "create_calendar_event"]},
        "arguments": {
            "type": "object",
            "properties": {
                "search_query_text": {"type": "string", "maxLength": 40},
                "maximum_number_of_results": {"type": "integer", "minimum": 1, "maximum": 20},
                "include_archived_documents": {"type": "boolean"},
            },
            "required": ["search_query_text", "maximum_number_of_results",
                         "include_archived_documents"],
            "additionalProperties": False,
        },
    },
    "required": ["function_name", "arguments"],
    "additionalProperties": False,
}  # fmt: skip
QUESTIONS = (
    "Find our notes about the 2024 budget review.",
    "Look up the onboarding checklist for new engineers.",
    "Search for the incident report from last Tuesday.",
    "Find documents about the office move, including old ones.",
)


def run(llm, requests: int) -> tuple[float, list[list[int]]]:
    """(output tok/s, tokens) for `requests` chats, one at a time."""
    from engine import SamplingParams, StructuredOutputs

    params = SamplingParams(
        max_tokens=200, temperature=0.0, structured_outputs=StructuredOutputs.json_schema(SCHEMA)
    )
    tokens, start = [], time.perf_counter()
    for i in range(requests):
        chat = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        (out,) = llm.chat([chat], params, use_tqdm=False)
        tokens.append(out.token_ids)
    return sum(map(len, tokens)) / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    args = parser.parse_args()
    from engine import LLM

    print(machine_line(), flush=True)
    engines = {"off": LLM(), "on": LLM(speculative="ngram")}
    run(engines["off"], 1), run(engines["on"], 1)  # warm up
    rates: dict[str, list[float]] = {"off": [], "on": []}
    outputs = {}
    for round_ in range(args.rounds):
        for name in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            rate, outputs[name] = run(engines[name], args.requests)
            rates[name].append(rate)
            print(f"round {round_ + 1} {name}: {rate:.1f} out tok/s", flush=True)
    assert outputs["on"] == outputs["off"], "speculation changed the output"
    stats = engines["on"].engine.core.speculator.stats
    ratio = statistics.median(on / off for on, off in zip(rates["on"], rates["off"], strict=True))
    print(
        f"median out tok/s: off {statistics.median(rates['off']):.1f}, "
        f"on {statistics.median(rates['on']):.1f}; on / off {ratio:.2f}x (median of rounds)"
    )
    print(f"drafts kept: {stats.num_accepted_tokens} of {stats.num_draft_tokens}; "
          f"tokens per request {statistics.mean(map(len, outputs['on'])):.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
