"""The batch-1 decode step of a Qwen3.5 GGUF through the native decode stack against the
model's Python layers, in turns in one process (issue 65).

    .venv/bin/python bench/results/2026-11-30-qwen35-zen3/stack_ab.py FILE [ROUNDS]

A step's time is (33 tokens - 1 token) / 32 for one request whose 500-token prompt is a
prefix-cache hit (a warm-up request first caches it); both print their greedy tokens' equality.
"""

from __future__ import annotations

import statistics
import sys
import time

from engine import LLM, SamplingParams


def main(path: str, rounds: int) -> None:
    llm = LLM(path, max_model_len=2048)
    runner = llm.engine.core.runner
    stack = runner.decode_stack
    assert stack is not None, llm.engine.core.compute_summary
    prompt = list(range(100, 600))

    def seconds(tokens: int) -> float:
        start = time.perf_counter()
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    seconds(1)  # the cold prefill, cached for the rounds
    steps: dict[str, list[float]] = {"stack": [], "python": []}
    tokens: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name in steps:
            runner.decode_stack = stack if name == "stack" else None
            one = seconds(1)
            steps[name].append((seconds(33) - one) / 32 * 1000)
            params = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
            tokens[name] = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    for name, ms in steps.items():
        print(name, "median step ms", round(statistics.median(ms), 1), [round(x, 1) for x in ms])
    ratio = statistics.median(steps["python"]) / statistics.median(steps["stack"])
    print("python / stack", round(ratio, 2), "same tokens:", tokens["stack"] == tokens["python"])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
