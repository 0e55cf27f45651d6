"""The soak's workload: its config and every request it sends, in send order, the same for
the same config and model (`pagedserve bench soak`, bench/soak.py).

Completions and chat, streaming and not, some with n > 1; every prompt is one of a few long
shared prefixes (chat: the system message) plus a question of its own; a fraction of the
well-formed requests leave early on purpose, and a fraction are malformed, the kinds of
MALFORMED_KINDS in turn. No httpx here: the plan is only data.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from bench.arguments import MALFORMED_KIND_NAMES
from bench.workloads import SEPARATOR, WORDS

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# Every malformed kind answered 200 is a validation hole and fails the soak. The names
# live in bench.arguments, which must build its parser without importing httpx.
MALFORMED_KINDS = MALFORMED_KIND_NAMES
# n at the protocol's maximum times many prompts: far more sequences than any batch holds.
FAN_OUT_N, FAN_OUT_PROMPTS = 128, 1024


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 2000
    rate: float | None = 20.0  # Poisson arrivals per second; None: all at once
    concurrency: int = 256  # client requests in flight at most
    max_tokens: int = 16  # each well-formed request asks for max_tokens/2..max_tokens
    num_prefixes: int = 4
    prefix_words: int = 200
    seed: int = 0
    disconnect_fraction: float = 0.2
    malformed_fraction: float = 0.05
    multi_choice_fraction: float = 0.1  # requests with n in 2..4
    malformed_kinds: tuple[str, ...] = MALFORMED_KINDS
    timeout_s: float = 300.0  # httpx's per-operation timeout (connect, each read)
    settle_timeout_s: float = 60.0  # how long the server may take to free everything

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("num_requests, concurrency and max_tokens must be at least 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        bad = [k for k in self.malformed_kinds if k not in MALFORMED_KINDS]
        if bad:
            raise ValueError(f"unknown malformed kind(s) {', '.join(bad)}")


@dataclass(frozen=True)
class Planned:
    index: int
    kind: str  # "completion", "chat" or a malformed kind
    path: str
    body: bytes  # raw, so malformed bodies can be sent as they are
    stream: bool = False
    leave_after_events: int | None = None  # a stream we close after this many events
    leave_after_s: float | None = None  # a non-streaming request we give up on
    malformed: bool = False


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def shared_prefixes(cfg: SoakConfig) -> list[str]:
    return [
        f"Context {g}: " + _words(random.Random(f"soak/{cfg.seed}/prefix/{g}"), cfg.prefix_words)
        for g in range(cfg.num_prefixes)
    ]


def plan_requests(cfg: SoakConfig, model: str | None) -> list[Planned]:
    """Every request of the run, in send order; the same for the same config and model."""
    rng = random.Random(f"soak/{cfg.seed}")
    prefixes = shared_prefixes(cfg)
    plan: list[Planned] = []
    num_malformed = 0
    for i in range(cfg.num_requests):
        if cfg.malformed_kinds and rng.random() < cfg.malformed_fraction:
            # In turn rather than at random: a short run still sees every kind.
            kind = cfg.malformed_kinds[num_malformed % len(cfg.malformed_kinds)]
            num_malformed += 1
            plan.append(malformed_request(i, kind, rng, model))
        else:
            plan.append(wellformed_request(i, cfg, rng, prefixes[i % len(prefixes)], model))
    return plan


def wellformed_request(
    index: int, cfg: SoakConfig, rng: random.Random, prefix: str, model: str | None
) -> Planned:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    n = rng.randint(2, 4) if rng.random() < cfg.multi_choice_fraction else 1
    question = f"Question {index}: {_words(rng, 8)}?"
    body: dict[str, Any] = {
        "max_tokens": rng.randint(max(cfg.max_tokens // 2, 1), cfg.max_tokens),
        "ignore_eos": True,  # every answer runs to max_tokens: a predictable load
        "temperature": 0.0 if n == 1 else 0.8,
    }
    if model is not None:
        body["model"] = model
    if chat:
        body["messages"] = [
            {"role": "system", "content": prefix},
            {"role": "user", "content": question},
        ]
    else:
        body["prompt"] = f"{prefix}{SEPARATOR}{question}\nAnswer:"
    if n > 1:
        body.update(n=n, seed=index)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    leaves = rng.random() < cfg.disconnect_fraction
    return Planned(
        index,
        "chat" if chat else "completion",
        CHAT if chat else COMPLETIONS,
        json.dumps(body).encode(),
        stream=stream,
        leave_after_events=rng.randint(1, 3) if leaves and stream else None,
        leave_after_s=rng.uniform(0.05, 1.0) if leaves and not stream else None,
    )


def malformed_request(index: int, kind: str, rng: random.Random, model: str | None) -> Planned:
    chat = rng.random() < 0.5
    path = CHAT if chat else COMPLETIONS
    base: dict[str, Any] = {"max_tokens": 4}
    if model is not None:
        base["model"] = model

    def text(value: Any) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": value}]} if chat else {"prompt": value}

    if kind == "invalid-json":
        raw = json.dumps({**base, **text("cut off")})[:-7].encode()  # the closing part missing
        return Planned(index, kind, path, raw, malformed=True)
    if kind == "wrong-type":
        body = {**base, "max_tokens": "many", **({"messages": "hello"} if chat else {"prompt": 7})}
    elif kind == "negative-max-tokens":
        body = {**base, **text("hello"), "max_tokens": -rng.randint(1, 100)}
    elif kind == "unknown-model":
        body = {**base, **text("hello"), "model": f"no-such-model-{index}"}
    elif kind == "lone-surrogate":
        # json.dumps escapes it as \ud800: valid JSON text, but no valid UTF-8 string.
        body = {**base, **text(f"half a character: \ud800 (request {index})")}
    elif kind == "huge-fan-out":
        path = COMPLETIONS  # only completions take a list of prompts
        prompts = [[100 + p % 1000, 200] for p in range(FAN_OUT_PROMPTS)]
        body = {**base, "prompt": prompts, "n": FAN_OUT_N, "max_tokens": 1}
    else:
        raise ValueError(f"unknown malformed kind {kind!r}")
    return Planned(index, kind, path, json.dumps(body).encode(), malformed=True)
