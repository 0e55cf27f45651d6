"""A GGUF's tokenizer, built from the file's own vocabulary with the `tokenizers` library.

llama.cpp stores a tokenizer as metadata: `tokenizer.ggml.model` names the kind (`gpt2`:
byte-level BPE with `.merges`; `llama`: SentencePiece with `.scores` and byte fallback),
`.tokens` the vocabulary, `.token_type` which are control (3) or user-defined (4) tokens,
`.pre` the pre-tokenizer the merges were learned with, plus the special ids, whether to add
bos/eos, and `tokenizer.chat_template`. `gguf_tokenizer` builds the same `Tokenizer` that
transformers' GGUF reader builds from them (the tests hold the two to the same ids), and
`tokenizer_config` the tokenizer_config.json fields of it; no transformers import.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers import models as tokenizer_models

from engine.errors import ModelFileError
from engine.gguf_config import gguf_architecture
from engine.gguf_file import ArrayInfo, GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)
SPIECE_SPACE = "\u2581"

# `tokenizer.ggml.pre` -> the split regex llama.cpp applies before byte-level BPE
# (llama-vocab.cpp); a name not here splits as GPT-2 does.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_CASED = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*")  # fmt: skip
_TEKKEN = f"{_CASED[0]}|{_CASED[1]}" + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (f"{_CASED[0]}{_CONTRACTIONS}|{_CASED[1]}{_CONTRACTIONS}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
SPLIT_REGEXES = {
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3, "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2, "qwen35": _QWEN35,
    "tekken": _TEKKEN, "gpt-4o": _GPT4O, "llama4": _GPT4O,
}  # fmt: skip


# Control tokens that end an assistant's turn in their families' chat templates; llama.cpp
# ends generation at them too (llama-vocab.cpp's end-of-generation tokens), while a file's
# eos is often the end of a document (Gemma 3: <eos>, its turns end with <end_of_turn>).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE spells every token in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


# What a vocabulary may hold before anything is built from it. Real ones: up to 262,144
# tokens (Gemma 3), none longer than a few hundred bytes (SmolLM2's longest: 81), a few MB
# of text in all, up to ~2.2 merges a token (Llama 3: 280,147 for 128,256). Beyond these a
# file (whose arrays the reader checked against its size) could still make the build take
# hours: SentencePiece's merges are derived from every cut of every token.
MAX_VOCAB = 1 << 21
MAX_TOKEN_BYTES = 1024
MAX_VOCAB_BYTES = 16 << 20
MAX_MERGES_PER_TOKEN = 4


def check_vocabulary(gguf: GGUFFile) -> list[str]:
    """The file's tokens, after their count, lengths and merges are checked against the
    bounds above (their count against the embedding's rows: engine/model_check.py);
    `ModelFileError` naming the key and the bound otherwise."""
    key = "tokenizer.ggml.tokens"
    info = gguf.metadata.get(key)
    count = info.count if isinstance(info, ArrayInfo) else 0
    if count > MAX_VOCAB:
        raise ModelFileError(f"{gguf.path}: {key} holds {count:,} tokens, over the "
                             f"{MAX_VOCAB:,} a vocabulary may hold")  # fmt: skip
    tokens = gguf.read_array(key)
    if not isinstance(tokens, list) or not tokens:
        raise ModelFileError(f"{gguf.path}: the file has no vocabulary ({key})")
    _check_strings(gguf, key, tokens, MAX_TOKEN_BYTES, MAX_VOCAB_BYTES)
    key = "tokenizer.ggml.merges"
    merges = gguf.metadata.get(key)
    if isinstance(merges, ArrayInfo):
        if merges.count > MAX_MERGES_PER_TOKEN * len(tokens):
            raise ModelFileError(f"{gguf.path}: {key} holds {merges.count:,} merges for "
                                 f"{len(tokens):,} tokens, over {MAX_MERGES_PER_TOKEN} a "
                                 "token")  # fmt: skip
        values = gguf.read_array(key)
        if not isinstance(values, list):
            raise ModelFileError(f"{gguf.path}: {key} is not an array of strings")
        _check_strings(gguf, key, values, 2 * MAX_TOKEN_BYTES + 1, None)
    return tokens


def _check_strings(gguf: GGUFFile, key: str, values: list[str], longest: int,
                   total: int | None) -> None:  # fmt: skip
    """Each of ``values`` at most ``longest`` UTF-8 bytes, all together at most ``total``
    (counted in characters first: a character is 1 to 4 bytes)."""
    chars = max(map(len, values), default=0)
    if chars * 4 > longest:
        index, size = max(((i, _utf8(v)) for i, v in enumerate(values) if len(v) * 4 > longest),
                          key=lambda found: found[1])  # fmt: skip
        if size > longest:
            raise ModelFileError(f"{gguf.path}: {key}[{index:,}] is {size:,} bytes long, over "
                                 f"the {longest:,} one may be")  # fmt: skip
    if total is not None and sum(map(len, values)) * 4 > total:
        size = sum(map(_utf8, values))
        if size > total:
            raise ModelFileError(f"{gguf.path}: {key} holds {size:,} bytes of text, over "
                                 f"the {total:,} a vocabulary may")  # fmt: skip


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def gguf_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The file's tokenizer; `ModelFileError` for a kind this module does not build, or a
    vocabulary past `check_vocabulary`'s bounds."""
    kind = gguf.metadata.get("tokenizer.ggml.model")
    tokens = check_vocabulary(gguf)
    types = gguf.read_array("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFileError(f"{gguf.path}: {len(types):,} token types for {len(tokens):,} tokens")
    if kind == "gpt2":
        tokenizer = _byte_level(gguf, tokens)
        alphabet = set(byte_alphabet().values())
        controls = [t for t, k in zip(tokens, types, strict=True)
                    if k == CONTROL and set(t) <= alphabet]  # fmt: skip
    elif kind == "llama":
        tokenizer = _sentencepiece(gguf, tokens)
        controls = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    else:
        raise ModelFileError(f"{gguf.path}: tokenizer kind {kind!r} (tokenizer.ggml.model) is "
                             "not supported (gpt2, llama)")  # fmt: skip
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in controls])
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    user = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    _bos_eos_post_processor(tokenizer, tokenizer_config(gguf))
    return tokenizer


def _byte_level(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:  # a token written in plain text: spell its bytes
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index  # a token listed twice: its last id, as llama.cpp's map has it
    merges = gguf.read_array("tokenizer.ggml.merges") or []
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    model = tokenizer_models.BPE(vocab, pairs, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False)  # fmt: skip
    tokenizer = Tokenizer(model)
    split = SPLIT_REGEXES.get(gguf.metadata.get("tokenizer.ggml.pre"))
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    """SentencePiece BPE with byte fallback. Its merges are not in the file: they are
    every split of a token into two tokens, best first by score (Gemma: by the order of the
    vocabulary, which its scores do not follow)."""
    arch = gguf_architecture(gguf)
    if arch.startswith("gemma"):  # a run of spaces is stored as spaces, looked up as U+2581
        tokens = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = gguf.read_array("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelFileError(f"{gguf.path}: a SentencePiece vocabulary without a score "
                                 "per token (tokenizer.ggml.scores)")  # fmt: skip
        rank = dict(zip(tokens, (float(s) for s in scores), strict=True))
    vocab = {token: index for index, token in enumerate(tokens)}  # a repeat: its last id
    unk = gguf.metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    model = tokenizer_models.BPE(vocab, derive_merges(vocab, rank), dropout=None, fuse_unk=True,
                                 byte_fallback=True, unk_token=unk_token)  # fmt: skip
    tokenizer = Tokenizer(model)
    pieces = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch.startswith("gemma"):
        tokenizer.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":  # the prefix space from a normalizer, as Phi-3's tokenizer.json has it
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPIECE_SPACE), normalizers.Replace(" ", SPIECE_SPACE)]
        )
        pieces.append(decoders.Strip(content=" ", left=1))
    else:
        prefix = gguf.metadata.get("tokenizer.ggml.add_space_prefix", True) is not False
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            pieces.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(pieces)
    return tokenizer


def derive_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: each way to cut a token in two
    tokens, ordered by the merged token's rank (highest first), then the shorter left and
    right parts, then the parts' ids."""
    found = []
    for token, score in rank.items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token))]
        cuts = [(a, b) for a, b in cuts if a in vocab and b in vocab]
        cuts.sort(key=lambda cut: (vocab[cut[0]], vocab[cut[1]]))
        found.extend((score, a, b) for a, b in cuts)
    # a stable sort: equal keys keep the order above, as transformers' generate_merges has it
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(a, b) for _, a, b in found]


def end_of_generation_ids(gguf: GGUFFile) -> list[int]:
    """The ids that end generation: the file's eos, its eot/eom ids, and its control tokens
    of `END_OF_TURN_TOKENS` (in that order, once each)."""
    meta = gguf.metadata
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = gguf.read_array("tokenizer.ggml.tokens") or []
    types = gguf.read_array("tokenizer.ggml.token_type")
    if types is not None and len(types) == len(tokens):
        wanted = set(END_OF_TURN_TOKENS)
        ids += [i for i, (t, k) in enumerate(zip(tokens, types, strict=True))
                if k == CONTROL and t in wanted]  # fmt: skip
    valid = (i for i in ids if isinstance(i, int) and 0 <= i < max(len(tokens), 1))
    return list(dict.fromkeys(valid))


def tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    """tokenizer_config.json's fields: the special tokens by name, whether bos/eos are
    added, the chat template (None when the file has none)."""
    meta = gguf.metadata
    tokens = gguf.read_array("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {"tokenizer_class": "TokenizersBackend",
                              "clean_up_tokenization_spaces": False}  # fmt: skip
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):  # fmt: skip
        index = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) \
            else None  # fmt: skip
    # llama.cpp adds bos to a SentencePiece vocabulary that does not say otherwise
    default_bos = meta.get("tokenizer.ggml.model") == "llama"
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = meta.get("tokenizer.chat_template")
    config["chat_template"] = template if isinstance(template, str) else None
    return config


def _bos_eos_post_processor(tokenizer: Tokenizer, config: dict[str, Any]) -> None:
    """The template that adds bos/eos around an encoded text, as transformers' fast
    tokenizers set it (`add_special_tokens=False` skips it)."""
    from tokenizers import processors

    bos = config["bos_token"] if config["add_bos_token"] else None
    eos = config["eos_token"] if config["add_eos_token"] else None
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special = [(t, tokenizer.token_to_id(t)) for t in (bos, eos) if t]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )
