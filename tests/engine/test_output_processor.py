"""The output processor: the core's token ids into text, stop strings (aborted in the core
through `reqs_to_abort`), the core's own finishes, logprobs, and its per-request state."""

from __future__ import annotations

import pytest

from engine.output_processor import OutputProcessor
from engine.outputs import EngineCoreOutput, TokenLogprob
from scheduler.sampling_params import SamplingParams
from tests.engine.tiny_models import default_tokenizer

PROMPT = "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n"
TEXT = " one two three four"


@pytest.fixture(scope="module")
def tok():
    return default_tokenizer()


def start(tok, **params) -> tuple[OutputProcessor[str], list[int]]:
    processor: OutputProcessor[str] = OutputProcessor(tok)
    processor.add_request("r", tok.encode(PROMPT), SamplingParams(**params), "client-r")
    return processor, tok.encode(TEXT, add_special_tokens=False)


def feed(processor, token_ids, finish_at=None, finish_reason="length", stop_reason=None):
    """The core's outputs one token a step; it finishes the request at index `finish_at`."""
    results = []
    for i, token_id in enumerate(token_ids):
        done = i == finish_at
        core = EngineCoreOutput("r", [token_id], finish_reason if done else None,
                                stop_reason if done else None)  # fmt: skip
        results.append(processor.process([core]))
        if done:
            break
    return results


def test_text_streams_and_the_core_finish_flushes_it(tok):
    processor, ids = start(tok, stop=["nine"])  # a stop string holds text back at times
    results = feed(processor, ids, finish_at=len(ids) - 1)
    outputs = [out for r in results for _, out in r.outputs]
    assert "".join(o.new_text for o in outputs) == TEXT
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert outputs[-1].text == TEXT and outputs[-1].token_ids == ids
    assert not any(r.reqs_to_abort for r in results)  # the core finished it itself
    assert len(processor) == 0  # its state went with its last output
    assert results[0].outputs[0][0].client == "client-r"


def test_a_stop_string_finishes_it_here_and_asks_the_core_to_abort_it(tok):
    processor, ids = start(tok, stop=[" three"])
    results = feed(processor, ids)  # the core never finishes it
    finished = [(i, out) for i, r in enumerate(results) for _, out in r.outputs if out.finished]
    ((index, out),) = finished
    assert out.finish_reason == "stop" and out.stop_string == " three"
    assert out.text == " one two"
    assert results[index].reqs_to_abort == ["r"]
    # The core may step it again before the abort lands: that token is dropped.
    assert all(not r.outputs for r in results[index + 1 :])
    assert len(processor) == 0


def test_a_stop_token_leaves_its_text_out_and_needs_no_abort(tok):
    processor, ids = start(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    results = feed(processor, [*ids, eos], finish_at=len(ids), finish_reason="stop",
                   stop_reason=eos)  # fmt: skip
    last = results[-1].outputs[0][1]
    assert last.finished and last.finish_reason == "stop" and last.text == TEXT
    assert last.stop_string is None and not results[-1].reqs_to_abort


def test_a_completed_grammar_stops_it_and_flushes_the_held_back_text(tok):
    # The core finishes a constrained request with "stop" and no stop token: the text
    # held back as a possible stop string's start is kept, unlike a stop string's cut.
    processor, ids = start(tok, stop=[" four five"])
    results = feed(processor, ids, finish_at=len(ids) - 1, finish_reason="stop")
    last = results[-1].outputs[0][1]
    assert last.finish_reason == "stop" and last.text == TEXT and last.stop_string is None
    assert not results[-1].reqs_to_abort


def test_a_queue_timeout_ends_it_without_tokens(tok):
    processor, _ = start(tok)
    result = processor.process([EngineCoreOutput("r", [], "queue_timeout")])
    ((_, out),) = result.outputs
    assert out.finished and out.finish_reason == "queue_timeout"
    assert out.text == "" and out.token_ids == [] and not result.reqs_to_abort


def test_logprobs_accumulate_per_request(tok):
    processor, ids = start(tok, logprobs=1)
    outs = []
    for i, token_id in enumerate(ids[:3]):
        lp = TokenLogprob(token_id, -0.5 * (i + 1))
        core = EngineCoreOutput("r", [token_id], new_logprobs=[lp])
        outs += [out for _, out in processor.process([core]).outputs]
    assert [lp.logprob for lp in outs[-1].logprobs] == [-0.5, -1.0, -1.5]
    assert [len(o.new_logprobs) for o in outs] == [1, 1, 1]


def test_unknown_and_removed_requests_are_ignored(tok):
    processor, ids = start(tok)
    assert not processor.process([EngineCoreOutput("nobody", [ids[0]])]).outputs
    assert [s.request_id for s in processor.remove(["r", "nobody"])] == ["r"]
    assert not processor.process([EngineCoreOutput("r", [ids[0]])]).outputs
    with pytest.raises(ValueError, match="already in use"):
        processor.add_request("x", [1], SamplingParams(), "a")
        processor.add_request("x", [1], SamplingParams(), "b")
