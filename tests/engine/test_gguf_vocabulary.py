"""What a GGUF's vocabulary makes the server build (issue 64): the tokenizer comes from the
file's metadata (engine/gguf_tokenizer.py), so its size, its tokens' lengths and its
merges are bounded before anything is built from them, and a seeded fuzz of small real
vocabularies (byte-level BPE and SentencePiece) either converts to a working tokenizer or
is refused with one line, in bounded time and memory, as the reader's header fuzz does
for the file's structure (tests/engine/test_model_file_damage.py)."""

from __future__ import annotations

import copy
import json
import random
import re
import resource
import struct
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from engine import gguf_tokenizer
from engine.errors import ModelFileError
from engine.loader import convert_gguf, load_tokenizer
from tests.engine.gguf_models import _write_vocab, spm_vocab

REPO = Path(__file__).resolve().parents[2]
HIDDEN = 32


@lru_cache(maxsize=1)
def small_bpe_vocab() -> dict:
    """A byte-level BPE vocabulary of ~400 tokens and its merges, learned from the quality
    text as a GGUF holds it (GPT-2's byte alphabet)."""
    text = (REPO / "tests" / "data" / "quality_text.txt").read_text()
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    learner.train_from_iterator(text.splitlines(), trainer)
    model = json.loads(learner.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return {"model": "gpt2", "pre": "qwen2", "tokens": tokens, "merges": merges,
            "types": [1] * len(tokens), "bos": 0, "eos": 1, "unk": 0, "pad": 1,
            "add_bos": False}  # fmt: skip


def write_vocab_gguf(path: Path, vocab: dict, rows: int | None = None) -> Path:
    """A one-layer llama GGUF around ``vocab``, its embedding ``rows`` long (default: one
    row a token, as a converted model's is)."""
    rng = np.random.default_rng(0)
    rows = len(vocab["tokens"]) if rows is None else rows
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    _write_vocab(w, vocab, None, "llama")

    def dense(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))

    dense("token_embd.weight", rows, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for proj, shape in (("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (16, HIDDEN)),
                        ("attn_v", (16, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                        ("ffn_gate", (64, HIDDEN)), ("ffn_up", (64, HIDDEN)),
                        ("ffn_down", (HIDDEN, 64))):  # fmt: skip
        dense(f"blk.0.{proj}.weight", *shape)
    for norm in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{norm}.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _convert(path: Path, cache: Path) -> str:
    """The outcome: "loaded" (a tokenizer that encodes and decodes), or the refusal's line."""
    try:
        tokenizer = load_tokenizer(convert_gguf(path, cache))
    except ModelFileError as exc:
        message = str(exc)
        assert message.startswith(f"{path}: ") and "\n" not in message, message
        return message
    ids = tokenizer.encode("Hello, wörld! 12 ")
    assert isinstance(tokenizer.decode(ids), str)
    return "loaded"


@pytest.fixture(scope="module")
def seeds() -> dict[str, dict]:
    return {"bpe": small_bpe_vocab(), "spm": spm_vocab(300)}


def test_the_seeds_convert(tmp_path, seeds):
    for kind, vocab in seeds.items():
        assert _convert(write_vocab_gguf(tmp_path / f"{kind}.gguf", vocab), tmp_path) == "loaded"


# (the vocabulary's change, what the one line says)
BOUNDS = {
    "a token over 1,024 bytes": (
        lambda v: v["tokens"].__setitem__(7, "é" * 513),
        r"tokenizer\.ggml\.tokens\[7\] is 1,026 bytes long, over the 1,024 one may be"),
    "five merges a token": (
        lambda v: v.__setitem__("merges", v["merges"] * (5 * len(v["tokens"]) // len(v["merges"]) + 1)),
        r"tokenizer\.ggml\.merges holds [\d,]+ merges for [\d,]+ tokens, over 4 a token"),
    "a merge over 2,049 bytes": (
        lambda v: v["merges"].__setitem__(0, "a" * 2050),
        r"tokenizer\.ggml\.merges\[0\] is 2,050 bytes long"),
    "one token more than the embedding's rows": (
        lambda v: (v["tokens"].append("zzz_extra"), v["types"].append(1)),
        r"model\.embed_tokens\.weight is \[\d+, 32\], the config needs \[\d+, 32\]"),
}  # fmt: skip


@pytest.mark.parametrize("case", BOUNDS)
def test_a_vocabulary_past_a_bound_is_one_line_naming_it(tmp_path, seeds, case):
    change, message = BOUNDS[case]
    vocab = copy.deepcopy(seeds["bpe"])
    rows = len(vocab["tokens"])
    change(vocab)
    path = write_vocab_gguf(tmp_path / "v.gguf", vocab, rows)
    refusal = _convert(path, tmp_path / "cache")
    assert refusal != "loaded"
    assert re.search(message, refusal), refusal
    assert not list((tmp_path / "cache" / "models").glob("v-*")), "a cache entry was left"


def test_the_vocabularys_size_and_text_are_bounded(tmp_path, seeds, monkeypatch):
    # (the real bounds, 2,097,152 tokens and 16 MiB, take files of hundreds of MB to reach)
    path = write_vocab_gguf(tmp_path / "v.gguf", seeds["spm"])
    n = len(seeds["spm"]["tokens"])
    monkeypatch.setattr(gguf_tokenizer, "MAX_VOCAB", n - 1)
    assert f"tokenizer.ggml.tokens holds {n:,} tokens, over the {n - 1:,}" in _convert(
        path, tmp_path / "a"
    )
    monkeypatch.setattr(gguf_tokenizer, "MAX_VOCAB", 1 << 21)
    monkeypatch.setattr(gguf_tokenizer, "MAX_VOCAB_BYTES", 1000)
    assert "bytes of text, over the 1,000 a vocabulary may" in _convert(path, tmp_path / "b")


# -- the fuzz -----------------------------------------------------------------------------

LENGTHS = (0, 1, 2, 1024, 1025, 5000, 100_000)
CHARS = ("a", "é", "Ġ", "\u2581", "\x00", " ", "\n", "<0x41>")


def mutate(seed: dict, rng: random.Random) -> tuple[dict, int | None]:
    """One change to a vocabulary (and the embedding's rows when it is not one a token)."""
    vocab = copy.deepcopy(seed)
    tokens, n = vocab["tokens"], len(vocab["tokens"])
    kind = rng.choice(("long", "long", "duplicate", "extra", "drop", "types", "merges",
                       "many merges", "ids", "model", "pre", "bytes", "scores"))  # fmt: skip
    rows = None
    if kind == "long":
        for _ in range(rng.randint(1, 3)):
            tokens[rng.randrange(n)] = rng.choice(CHARS) * rng.choice(LENGTHS)
    elif kind == "duplicate":
        tokens[rng.randrange(n)] = tokens[rng.randrange(n)]
    elif kind in ("extra", "drop"):
        rows = n
        if kind == "extra":
            tokens.extend(f"x{i}" for i in range(rng.randint(1, 50)))
        else:
            del tokens[rng.randrange(n) :]
        vocab["types"] = [1] * len(tokens)
        if "scores" in vocab:
            vocab["scores"] = [0.0] * len(tokens)
    elif kind == "types":
        vocab["types"] = vocab["types"][: rng.randrange(n)] or [1]
    elif kind == "scores" and "scores" in vocab:
        vocab["scores"] = vocab["scores"][:-1]
    elif kind in ("merges", "many merges") and "merges" in vocab:
        garbage = ["", " ", "a", "a b c", "zz qq", "Ġ" * 1025 + " a", "\x00 \x00"]
        extra = [rng.choice(garbage) for _ in range(rng.randint(1, 20))]
        if kind == "many merges":
            extra *= 5 * n // len(extra) + 1
        vocab["merges"] = vocab["merges"] + extra
    elif kind == "ids":
        vocab[rng.choice(("bos", "eos", "unk", "pad"))] = rng.choice((n, 2**32 - 1, n - 1))
    elif kind == "model":
        vocab["model"] = rng.choice(("bert", "", "gpt2", "llama"))
    elif kind == "pre":
        vocab["pre"] = rng.choice(("", "llama-bpe", "x" * 1000))
    elif kind == "bytes":
        tokens[rng.randrange(n)] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    return vocab, rows


def test_fuzzed_vocabularies_convert_or_are_refused_with_one_line(tmp_path, seeds):
    rng = random.Random(64)
    outcomes: dict[str, int] = {"loaded": 0, "refused": 0}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    slowest = 0.0
    for i in range(200):
        seed = seeds[rng.choice(("bpe", "spm"))]
        vocab, rows = mutate(seed, rng)
        path = write_vocab_gguf(tmp_path / f"f{i}.gguf", vocab, rows)
        if rng.random() < 0.15:  # and some damage in the vocabulary's own bytes
            raw = bytearray(path.read_bytes())
            at = rng.randrange(raw.index(b"tokenizer.ggml.tokens"), len(raw) // 2)
            if rng.random() < 0.5:
                raw[at] = rng.randrange(256)
            else:
                struct.pack_into("<Q", raw, at, rng.choice((0, 1, 2**31, 2**63 + 1)))
            path.write_bytes(bytes(raw))
        start = time.perf_counter()
        outcome = _convert(path, tmp_path / "cache")
        outcomes["loaded" if outcome == "loaded" else "refused"] += 1
        slowest = max(slowest, time.perf_counter() - start)
        path.unlink()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert outcomes["loaded"] >= 20 and outcomes["refused"] >= 20, outcomes
    assert slowest < 5.0, f"one file took {slowest:.1f} s"
    assert grown_mib < 256, f"peak memory grew {grown_mib:.0f} MiB"
