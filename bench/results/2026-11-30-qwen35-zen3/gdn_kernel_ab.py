"""The batch-1 decode step of a Qwen3.5 GGUF with the native Gated DeltaNet step against
torch's ops, in turns in one process (bench/README.md, "On an AVX2-only Zen 3").

    .venv/bin/python bench/results/2026-11-30-qwen35-zen3/gdn_kernel_ab.py FILE

A step's time is (33 tokens - 1 token) / 32 for one request whose 500-token prompt is a
prefix-cache hit after the first round; the first round's figure includes the cold prefill.
"""

from __future__ import annotations

import statistics
import sys
import time

from engine import LLM, SamplingParams
from engine.models import gated_delta_net

ROUNDS = 4


def main(path: str) -> None:
    llm = LLM(path, max_model_len=2048)
    prompt = list(range(100, 600))
    native = gated_delta_net.decode_kernels

    def seconds(tokens: int) -> float:
        start = time.perf_counter()
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        llm.generate([prompt], params)
        return time.perf_counter() - start

    steps: dict[str, list[float]] = {"kernel": [], "torch": []}
    for _ in range(ROUNDS):
        for name in steps:
            gated_delta_net.decode_kernels = native if name == "kernel" else lambda *a, **k: None
            one = seconds(1)
            steps[name].append((seconds(33) - one) / 32 * 1000)
    for name, ms in steps.items():
        print(name, "median step ms", round(statistics.median(ms), 1), [round(x, 1) for x in ms])
    ratio = statistics.median(steps["torch"]) / statistics.median(steps["kernel"])
    print("torch / kernel", round(ratio, 2))


if __name__ == "__main__":
    main(sys.argv[1])
