"""Deterministic prompts of chosen token lengths for the load generator.

The workloads, all built from a fixed word list and a seed (same seed, same prompts):

- `shared-prefix`: P groups; every prompt of a group is the group's long fixed prefix
  followed by a short question no other prompt has. Request i belongs to group i % P.
- `zipf-prefix`: as shared-prefix, but request i's group is drawn with Zipf-like
  popularity (group g with weight 1 / (g + 1)): a few prefixes are hot, most are cold,
  so with many groups the distinct prefixes outgrow the KV pool and what stays cached
  decides the hit rate (issue 26's overflowing-prefix load).
- `bursty-prefix`: as shared-prefix with P new prefixes whose requests all arrive together,
  interleaved in a shuffled order: while the first request of a prefix prefills, its
  followers and other prefixes' requests queue behind it (issue 26's cache-aware
  admission load).
- `unique`: the same lengths, but every prompt has a prefix of its own.
- `multi-turn`: conversations; turn k+1 resends the whole history (a unique context, the
  earlier questions and the answers the server gave) plus a new question.
- `copy-edit`: answers that repeat their prompt (issue 42's speculative-decoding load):
  each prompt holds a small Python file of its own (about 40 lines) and asks for the whole
  file back with one function renamed; `--prefix-len` and the question are not used.
- `repeat`: requests the server already answered (a retried or repeated agent step: the
  suffix-decoding load of issue 42): `--num-prefixes` distinct prompts, each a prefix and a
  question of its own, and request i asks prompt i % P, so from request P + 1 on every
  request repeats an earlier one word for word.
- `model-alternate`, `model-zipf`: the shared-prefix prompts sent to several models of one
  server (issue 44's load: `serve --models-dir`, llama-server's router mode): request i
  goes to model i % M, or to model m drawn with weight 1 / (m + 1); the load generator
  maps the index to a name (`--models`, else the names /v1/models lists, in its order).

Lengths are counted with the served model's tokenizer, loaded locally (other servers have
no /tokenize route). A prefix is exactly `prefix_len` tokens; a question starts with a
newline, which the byte-level BPE never merges with the word before it, so every prompt of a
group begins with the same `prefix_len` token ids (tests/bench checks this).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

WORKLOADS = ("shared-prefix", "zipf-prefix", "bursty-prefix", "unique", "multi-turn", "copy-edit",
             "repeat", "model-alternate", "model-zipf")  # fmt: skip
# Prompts sent to several models, each request to one (`Prompt.model_index`).
MODEL_WORKLOADS = ("model-alternate", "model-zipf")
# Prompts grouped by a shared prefix.
PREFIX_WORKLOADS = ("shared-prefix", "zipf-prefix", "bursty-prefix", *MODEL_WORKLOADS)

# Plain lower-case English words: each is one or two tokens in any byte-level BPE, so a
# prompt's token count follows its word count closely and trimming is exact.
_WORD_TEXT = """
    time year people way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot
    right study book eye job word business issue side kind head house service friend father
    power hour game line end member law car city community name president team minute idea
    kid body information back parent face others level office door health person art war
    history party result change morning reason research girl guy moment air teacher force
    education foot boy age policy process music market sense nation plan college interest
    death experience effect use class control care field development role effort rate heart
    drug show leader light voice wife police mind price report decision son view relationship
    town road arm difference value building action model season society tax director position
    player record paper space ground form event official matter center couple site project
    activity star table need court oil situation cost industry figure street image phone data
    picture practice piece land product doctor wall patient worker news test movie north love
    support technology step baby computer type attention film tree source organization hair
    window evidence population site river garden bridge valley mountain island forest ocean
    stone cloud winter summer spring autumn bread apple orange silver golden quiet gentle
    bright simple careful early late small large green blue red yellow black white open
"""
WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))  # in order, each once
SEPARATOR = "\n\n"


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def text_of_tokens(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> str:
    """Random words from `rng`, cut to exactly `num_tokens` tokens (re-encoding included)."""
    if num_tokens < 1:
        return ""
    words: list[str] = []
    while True:  # words are >= 1 token, so num_tokens words are always enough
        words.extend(rng.choice(WORDS) for _ in range(num_tokens - len(words)))
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
        if len(ids) >= num_tokens:
            break
    # Cutting at a token boundary can split a word, and a split word may re-encode to one
    # token more: then cut one token earlier (rare with these words).
    for cut in range(num_tokens, max(num_tokens - 4, 0), -1):
        text = tokenizer.decode(ids[:cut])
        if count_tokens(tokenizer, text) <= num_tokens:
            return text
    return tokenizer.decode(ids[:num_tokens])


def question_text(tokenizer: Tokenizer, rng: random.Random, index: int, num_tokens: int) -> str:
    """About `num_tokens` tokens of question, starting on a new line, numbered `index`."""
    head = f"{SEPARATOR}Question {index}:"
    body_len = max(num_tokens - count_tokens(tokenizer, head) - 3, 1)
    return f"{head} {text_of_tokens(tokenizer, rng, body_len)}?\nAnswer:"


def turn_text(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> str:
    """A multi-turn question of about `num_tokens` tokens."""
    return text_of_tokens(tokenizer, rng, max(num_tokens - 1, 1)) + "?"


@dataclass(frozen=True)
class Prompt:
    """One request's prompt (the text; chat sends it as one user message)."""

    text: str
    group: int  # the shared prefix's group (shared-, zipf-prefix); the request index otherwise
    model_index: int | None = None  # the model-* workloads: which of the models it goes to


@dataclass
class Conversation:
    """A multi-turn conversation: a context, then one question per turn."""

    context: str
    questions: list[str]
    answers: list[str] = field(default_factory=list)

    def completion_prompt(self, turn: int) -> str:
        """Turn `turn`'s prompt: context + earlier turns with their answers + this question."""
        parts = [self.context]
        for k in range(turn + 1):
            parts.append(f"{SEPARATOR}User: {self.questions[k]}\nAssistant:")
            if k < turn:
                parts.append(self.answers[k])
        return "".join(parts)

    def chat_messages(self, turn: int) -> list[dict[str, Any]]:
        """Turn `turn` as chat messages (the context opens the first user message)."""
        messages = []
        for k in range(turn + 1):
            content = self.questions[k] if k else self.context + SEPARATOR + self.questions[0]
            messages.append({"role": "user", "content": content})
            if k < turn:
                messages.append({"role": "assistant", "content": self.answers[k]})
        return messages


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "shared-prefix"
    num_requests: int = 64
    prefix_len: int = 500
    num_prefixes: int = 4
    question_len: int = 16
    turns: int = 4  # multi-turn only
    num_models: int = 2  # model-alternate and model-zipf only
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        for name in ("num_requests", "num_prefixes", "question_len", "turns", "num_models"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")

    @property
    def num_conversations(self) -> int:
        return -(-self.num_requests // self.turns)


def _rng(spec: WorkloadSpec, *key: object) -> random.Random:
    # A string seed is hashed with sha512: the same stream on every run and Python version.
    return random.Random("/".join(str(k) for k in (spec.seed, *key)))


def shared_prefixes(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[str]:
    return [
        text_of_tokens(tokenizer, _rng(spec, "prefix", g), spec.prefix_len)
        for g in range(spec.num_prefixes)
    ]


def build_prompts(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[Prompt]:
    """The prompts of a single-turn workload (all but `multi-turn`), in send order."""
    if spec.name == "multi-turn":
        raise ValueError("multi-turn is built with build_conversations")
    if spec.name == "copy-edit":
        return [Prompt(copy_edit_text(_rng(spec, "copy", i)), i) for i in range(spec.num_requests)]
    prefixes = shared_prefixes(spec, tokenizer) if spec.name in PREFIX_WORKLOADS else None
    groups = {"zipf-prefix": zipf_groups, "bursty-prefix": shuffled_groups}.get(spec.name)
    groups = groups(spec) if groups is not None else None
    models = model_indices(spec) if spec.name in MODEL_WORKLOADS else None
    prompts = []
    for request in range(spec.num_requests):
        # A repeat asks again, word for word, what prompt i % P asked.
        i = request % spec.num_prefixes if spec.name == "repeat" else request
        question = question_text(tokenizer, _rng(spec, "question", i), i, spec.question_len)
        if prefixes is not None:
            group = groups[request] if groups is not None else i % spec.num_prefixes
            prefix = prefixes[group]
        else:
            group = i
            prefix = text_of_tokens(tokenizer, _rng(spec, "unique", i), spec.prefix_len)
        prompts.append(Prompt(prefix + question, group, models[request] if models else None))
    return prompts


def model_indices(spec: WorkloadSpec) -> list[int]:
    """Each request's model: in turn (model-alternate), or model m drawn with weight
    1 / (m + 1) (model-zipf: the first model hot, the last one cold)."""
    if spec.name == "model-alternate":
        return [i % spec.num_models for i in range(spec.num_requests)]
    weights = [1.0 / (m + 1) for m in range(spec.num_models)]
    return _rng(spec, "models").choices(range(spec.num_models), weights=weights,
                                         k=spec.num_requests)  # fmt: skip


def copy_edit_text(rng: random.Random, num_functions: int = 6) -> str:
    """A request to return a small Python module whole, with one function renamed."""
    names = rng.sample(WORDS, 3 * num_functions)
    functions = []
    for f in range(num_functions):
        name, a, b = names[3 * f : 3 * f + 3]
        functions.append(
            f"def {name}_total({a}, {b}):\n"
            f'    """Return the {name} of {a} and {b}."""\n'
            f"    result = {a} * {f + 2} + {b}\n"
            f"    if result > {10 * (f + 1)}:\n"
            f"        return result - {a}\n"
            f"    return result\n"
        )
    old = names[0] + "_total"
    module = "\n\n".join(functions) + f"\n\nprint({old}(3, 4))\n"
    return (
        f"Here is a Python file:\n\n```python\n{module}```\n\nRewrite the whole file with "
        f"the function `{old}` renamed to `{names[0]}_sum` everywhere. Reply with the "
        "complete file only, in one ```python block."
    )


def zipf_groups(spec: WorkloadSpec, exponent: float = 1.0) -> list[int]:
    """Each request's prefix group, group g drawn with weight 1 / (g + 1) ** exponent."""
    weights = [1.0 / (g + 1) ** exponent for g in range(spec.num_prefixes)]
    rng = _rng(spec, "zipf")
    return rng.choices(range(spec.num_prefixes), weights=weights, k=spec.num_requests)


def shuffled_groups(spec: WorkloadSpec) -> list[int]:
    """Each request's prefix group: groups as equal as they divide, in a shuffled order."""
    groups = [i % spec.num_prefixes for i in range(spec.num_requests)]
    _rng(spec, "bursty").shuffle(groups)
    return groups


def build_conversations(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[Conversation]:
    """`num_requests` turns split into conversations of `turns` turns (the last may be short)."""
    conversations = []
    for c in range(spec.num_conversations):
        turns = min(spec.turns, spec.num_requests - c * spec.turns)
        context = text_of_tokens(tokenizer, _rng(spec, "context", c), spec.prefix_len)
        questions = [
            turn_text(tokenizer, _rng(spec, "turn", c, k), spec.question_len) for k in range(turns)
        ]
        conversations.append(Conversation(context, questions))
    return conversations
