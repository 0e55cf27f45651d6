"""What rendering a chat costs: the default model's chat template on a normal chat.

    .venv/bin/python -m bench.chat_template [--renders 20000] [--rounds 5] [--requests 200]

Renders a four-message chat (a system prompt, a question, an answer, a follow-up: 739
characters rendered) through `server.tokens.apply_chat_template`, the server's render of a
chat request, `--renders` times per round, and prints the median of the rounds' per-render
medians in microseconds, and the best round's (on a shared machine, the least disturbed).
Where the server renders on threads of its own (issue 64's `ChatRenderer`,
server/chat_renderer.py), also: the same render awaited through it from an event loop (the
thread hop included), and the largest chat the default model's context takes (1,000
messages, just under its prompt bound), which sets `--chat-template-timeout`'s default.
With `--requests N`: a fresh server of the default model (127.0.0.1) answers the same chat
N times with one token, and its median time is printed: the render among the rest of a
request. Issue 64's goal: the bounds on a render (docs/limits.md) cost nothing measurable.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.machine import machine_line
from engine.loader import load_tokenizer, resolve_model_dir
from server.tokens import apply_chat_template

CHAT = [
    {"role": "system", "content": "You are a concise assistant. Answer in one paragraph, "
     "cite no sources, and say so when you do not know."},
    {"role": "user", "content": "What is the difference between a process and a thread? "
     "I keep reading that threads share memory but processes do not, and I would like to "
     "know what that means in practice for a web server written in Python."},
    {"role": "assistant", "content": "A process has its own address space; its threads share "
     "it. In a Python web server, threads share objects (and the GIL), so one thread's "
     "long computation slows the others, while processes run truly in parallel but must "
     "copy what they exchange."},
    {"role": "user", "content": "So which should I use for a CPU-heavy endpoint?"},
]  # fmt: skip


def per_render_us(render, renders: int) -> float:
    times = []
    for _ in range(renders):
        start = time.perf_counter_ns()
        render()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def request_ms(count: int) -> list[float]:
    """Each of ``count`` one-token chat completions' time on a fresh default-model server,
    after 20 to warm it."""
    import httpx

    from bench.servers import free_port, launch, stop, wait_ready

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="chat-template-")) / "server.log"
    proc = launch([sys.executable, "-m", "server", "--port", str(port), "--log-level",
                   "warning"], log)  # fmt: skip
    try:
        wait_ready(url, proc, 600, log)
        body = {"model": "SmolLM2-135M-Instruct", "messages": CHAT, "max_tokens": 1,
                "temperature": 0}  # fmt: skip
        times = []
        with httpx.Client(base_url=url, timeout=60) as http:
            for i in range(count + 20):
                start = time.perf_counter()
                http.post("/v1/chat/completions", json=body).raise_for_status()
                if i >= 20:
                    times.append((time.perf_counter() - start) * 1000)
        return times
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--renders", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=0, help="chat requests to a server")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(resolve_model_dir(None))
    text = apply_chat_template(tokenizer, CHAT, True)
    print(machine_line())
    print(f"the default model's template on a {len(CHAT)}-message chat ({len(text)} characters)")
    rounds = [per_render_us(lambda: apply_chat_template(tokenizer, CHAT, True), args.renders)
              for _ in range(args.rounds)]  # fmt: skip
    print(f"render: median {statistics.median(rounds):.1f} us, best round {min(rounds):.1f} us "
          f"(rounds: {', '.join(f'{r:.1f}' for r in rounds)})")  # fmt: skip
    if args.requests:
        times = request_ms(args.requests)
        quartiles = statistics.quantiles(times, n=4)
        print(f"a one-token chat completion: median {statistics.median(times):.2f} ms "
              f"(quartiles {quartiles[0]:.2f}, {quartiles[2]:.2f}; {len(times)} requests)")  # fmt: skip
    try:
        from server.chat_renderer import ChatRenderer
    except ImportError:  # before issue 64: the server rendered on its event loop
        return 0
    renderer = ChatRenderer(tokenizer, max_model_len=8192)
    bound = renderer.limits.max_prompt_bytes
    large = [{"role": ("user", "assistant")[i % 2], "content": "word " * (bound // 5400)}
             for i in range(1000)]  # fmt: skip
    times = []
    for _ in range(5):
        start = time.perf_counter()
        text = renderer.render_now(large, True)
        times.append((time.perf_counter() - start) * 1000)
    print(f"the largest: 1,000 messages, {len(text):,} of the {bound:,} bytes the context takes: "
          f"median {statistics.median(times):.1f} ms of 5 (the first {times[0]:.1f} ms)")  # fmt: skip

    async def hop_rounds() -> list[float]:
        out = []
        for _ in range(args.rounds):
            times = []
            for _ in range(args.renders // 4):
                start = time.perf_counter_ns()
                await renderer.render(CHAT, True)
                times.append(time.perf_counter_ns() - start)
            out.append(statistics.median(times) / 1000)
        return out

    hops = asyncio.run(hop_rounds())
    print(f"render on the renderer's thread, awaited from an event loop: median "
          f"{statistics.median(hops):.1f} us (rounds: {', '.join(f'{r:.1f}' for r in hops)})")  # fmt: skip
    renderer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
