"""Incremental detokenizer: split characters, leading spaces, stop strings (spanning tokens,
held back, never retracted), special tokens, with the default model's real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from engine.detokenizer import IncrementalDetokenizer, decode_logprob_token
from scheduler.sampling_params import SamplingParams
from tests.engine.tiny_models import default_tokenizer

CHAT_PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
MIXED = "Hello 😀 世界 ✓ naïve"


@pytest.fixture(scope="module")
def tok():
    # The default model's tokenizer, as the suite's converted copy of its GGUF holds it.
    return default_tokenizer()


def stream(detok: IncrementalDetokenizer, token_ids: list[int]):
    """Feed tokens one by one; return the chunks and the index of the stopping token."""
    chunks, stopped_at = [], None
    for i, token_id in enumerate(token_ids):
        new_text, stopped = detok.add_token(token_id)
        chunks.append(new_text)
        if stopped:
            stopped_at = i
            break
    if stopped_at is None:
        chunks.append(detok.finish())
    return chunks, stopped_at


def detokenizer(tok, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, tok.encode(CHAT_PROMPT), SamplingParams(**params))


# --- characters split across tokens -----------------------------------------------------


def test_split_characters_only_appear_once_complete(tok):
    ids = tok.encode(MIXED + " and more 🎉🎉 한국어 text")
    # The case is real: some tokens hold only part of a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = detokenizer(tok)
    chunks, stopped_at = stream(detok, ids)
    assert stopped_at is None
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids) == detok.text
    assert detok.output_token_ids == ids
    # The emoji's first token yields nothing; its second yields the whole emoji.
    first_emoji = next(i for i, t in enumerate(ids) if "\ufffd" in tok.decode([t]))
    assert chunks[first_emoji] == ""
    assert "😀" in chunks[first_emoji + 1]


def test_finish_flushes_an_unfinished_character_like_a_full_decode(tok):
    ids = tok.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte is missing
    detok = detokenizer(tok)
    chunks, _ = stream(detok, cut)
    assert not any("\ufffd" in c for c in chunks[:-1])
    assert chunks[-1].endswith("\ufffd")
    assert detok.text == tok.decode(cut)


def test_without_prompt_context_output_starts_cleanly(tok):
    ids = tok.encode(" leading space and 世界")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    chunks, _ = stream(detok, ids)
    assert "".join(chunks) == tok.decode(ids)


def metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "▁Hi": 2, "▁there": 3, "▁friend": 4, "!": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def test_first_token_keeps_its_leading_space_with_sentencepiece_style_decoding():
    tok = metaspace_tokenizer()
    assert tok.decode([3, 4]) == "there friend"  # decoded alone, the space is stripped
    detok = IncrementalDetokenizer(tok, [2], SamplingParams())
    chunks, _ = stream(detok, [3, 4, 5])
    assert chunks[:3] == [" there", " friend", "!"]
    assert detok.text == tok.decode([2, 3, 4, 5])[len(tok.decode([2])) :]


class PlainTokenizer:
    """Only `decode`, like a slow tokenizer: exercises the detokenizer's fallback path."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=False):
        return self._tok.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
        )


def test_tokenizer_without_fast_backend_gives_the_same_text(tok):
    ids = tok.encode(MIXED + "<|im_end|>")
    prompt = tok.encode(CHAT_PROMPT)
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        fast, _ = stream(IncrementalDetokenizer(tok, prompt, params), ids)
        plain, _ = stream(IncrementalDetokenizer(PlainTokenizer(tok), prompt, params), ids)
        assert fast == plain


# --- special tokens ---------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    ids = tok.encode("Hi there<|im_end|>")
    assert tok.convert_ids_to_tokens(ids[-1]) == "<|im_end|>"
    detok = detokenizer(tok, skip_special_tokens=skip)
    chunks, _ = stream(detok, ids)
    assert detok.text == ("Hi there" if skip else "Hi there<|im_end|>")
    assert "".join(chunks) == detok.text


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_asked(tok, include):
    ids = tok.encode("Hi there<|im_end|>")
    detok = detokenizer(tok, skip_special_tokens=False, include_stop_str_in_output=include)
    chunks = [detok.add_token(t)[0] for t in ids[:-1]]
    new_text, stopped = detok.add_token(ids[-1], is_stop_token=True)
    assert not stopped and detok.finished  # finished by the token, not by a stop string
    assert "".join(chunks) + new_text == detok.text
    assert detok.text == ("Hi there<|im_end|>" if include else "Hi there")
    assert detok.output_token_ids == ids


# --- stop strings -----------------------------------------------------------------------


def stop_index(tok, ids: list[int], stop: str) -> int:
    """The first token after which the decoded output contains `stop`."""
    return next(i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1]))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "The weather today is sunny and warm."
    ids = tok.encode(text)
    stop = "ay is sun"
    assert not any(stop in tok.decode([t]) for t in ids)  # it really spans tokens
    detok = detokenizer(tok, stop=[stop], include_stop_str_in_output=include)
    chunks, stopped_at = stream(detok, ids)
    assert stopped_at == stop_index(tok, ids, stop)
    end = text.index(stop) + (len(stop) if include else 0)
    assert detok.text == text[:end] == "".join(chunks)
    assert detok.stopped and detok.stop_string == stop
    assert detok.output_token_ids == ids[: stopped_at + 1]
    # Later tokens change nothing.
    assert detok.add_token(ids[-1]) == ("", True)
    assert detok.finish() == ""


def test_stop_string_inside_one_token(tok):
    ids = tok.encode("Hello world")
    detok = detokenizer(tok, stop=["ell"])
    chunks, stopped_at = stream(detok, ids)
    assert stopped_at == 0
    assert chunks == ["H"] and detok.text == "H"


def test_earliest_stop_string_wins(tok):
    text = "one two three four"
    detok = detokenizer(tok, stop=["four", "two", "tw"])
    stream(detok, tok.encode(text))
    assert detok.text == "one " and detok.stop_string == "tw"


def test_text_that_may_start_a_stop_string_is_held_back_then_released(tok):
    text = " world, hello world!"
    ids = tok.encode(text)
    detok = detokenizer(tok, stop=["world!"])
    chunks = [detok.add_token(t)[0] for t in ids]
    # After " world" only the space is out: "world" may be the start of "world!".
    assert tok.decode(ids[:1]) == " world"
    assert chunks[0] == " "
    # The comma shows it was not a stop string: the held text comes out then.
    assert chunks[1] == "world,"
    assert detok.stopped and detok.text == " world, hello "
    assert "".join(chunks) == detok.text


def test_finish_flushes_held_back_text(tok):
    ids = tok.encode("I said hello wor")
    detok = detokenizer(tok, stop=["world"])
    streamed = [detok.add_token(t)[0] for t in ids]
    assert "".join(streamed) == "I said hello "
    assert detok.finish() == "wor"
    assert detok.text == "I said hello wor"
    assert detok.add_token(ids[0]) == ("", False)


def test_stop_strings_wait_for_min_tokens(tok):
    text = "stop now, then stop again"
    ids = tok.encode(text)
    first = stop_index(tok, ids, "stop")
    detok = detokenizer(tok, stop=["stop"], min_tokens=first + 2)
    chunks, stopped_at = stream(detok, ids)
    assert stopped_at is not None and stopped_at > first
    assert detok.text == "stop now, then " == "".join(chunks)


def test_decode_logprob_token(tok):
    hello, space_world = tok.encode("Hello world")
    assert decode_logprob_token(tok, hello) == "Hello"
    assert decode_logprob_token(tok, space_world) == " world"
    assert decode_logprob_token(tok, tok.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"


# --- the invariant, over many texts -----------------------------------------------------


def expected_output(tok, ids, stops, include):
    """Reference: decode every prefix of the output; stop at the first complete text with a
    stop string; cut at the earliest one. Without a stop, the full decode."""
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1])
        if text.endswith("\ufffd"):
            continue
        hits = [(text.find(s), len(s)) for s in stops if s in text]
        if hits:
            start, length = min(hits)
            return text[: start + length if include else start], i
    return tok.decode(ids), None


ALPHABET = "ab ,.\n世界😀é"


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
)
def test_streamed_chunks_are_final_and_match_a_full_decode(tok, text, stops, include):
    ids = tok.encode(text)
    detok = detokenizer(tok, stop=stops, include_stop_str_in_output=include)
    chunks, stopped_at = stream(detok, ids)
    expected_text, expected_stop = expected_output(tok, ids, stops, include)
    assert stopped_at == expected_stop
    assert "".join(chunks) == detok.text == expected_text
    assert not any("\ufffd" in c for c in chunks[:-1])
