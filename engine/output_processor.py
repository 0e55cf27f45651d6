"""The output processor: the engine core's token ids turned into what clients read.

It owns everything text-side of a request (`RequestState`): the incremental
detokenizer, stop strings, the logprobs gathered so far, and the caller's own per-request
object (`client`: the server keeps the request's stream and timeline there). It runs
wherever the caller wants it: the offline `LLMEngine` calls it on the stepping thread,
the server on its event loop, off the engine thread.

A stop string is the one way a request ends here: the request is finished for its client
at once, and `ProcessedOutputs.reqs_to_abort` names it so the caller aborts it in the
core through one call (as vLLM's output processor does). The core may have stepped it once
more meanwhile; that token is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import EngineCoreOutput, RequestOutput, TokenLogprob
from scheduler import SamplingParams

C = TypeVar("C")


@dataclass(slots=True)
class RequestState(Generic[C]):
    request_id: str
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None  # None unless the request asked for logprobs
    client: C


@dataclass
class ProcessedOutputs(Generic[C]):
    # Each output with its request's state (finished requests' states are already dropped).
    outputs: list[tuple[RequestState[C], RequestOutput]] = field(default_factory=list)
    # Requests a stop string finished here that the core still runs: abort them there.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor(Generic[C]):
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState[C]] = {}

    def __len__(self) -> int:
        """Requests added and not yet finished or removed."""
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, client: C
    ) -> None:
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self._states[request_id] = RequestState(
            request_id, prompt_token_ids, detokenizer, logprobs, client
        )

    def remove(self, request_ids: Iterable[str]) -> list[RequestState[C]]:
        """Forget requests (aborted, failed); returns the states of those it knew."""
        return [s for rid in request_ids if (s := self._states.pop(rid, None)) is not None]

    def remove_all(self) -> list[RequestState[C]]:
        states, self._states = list(self._states.values()), {}
        return states

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs[C]:
        processed: ProcessedOutputs[C] = ProcessedOutputs()
        for core_output in outputs:
            state = self._states.get(core_output.request_id)
            if state is None:  # finished here already (a stop string), or removed
                continue
            output, stopped_here = self._make_output(state, core_output)
            if output.finished:
                del self._states[state.request_id]
                if stopped_here:
                    processed.reqs_to_abort.append(state.request_id)
            processed.outputs.append((state, output))
        return processed

    @staticmethod
    def _make_output(state: RequestState[C], out: EngineCoreOutput) -> tuple[RequestOutput, bool]:
        """The request's output after this step, and whether a stop string ended it here."""
        detok = state.detokenizer
        finish_reason = out.finish_reason
        # The core stopped it on eos or a stop token id: that token's text is left out.
        stop_token = out.stop_reason is not None
        new_text = ""
        stopped_here = False
        last = len(out.new_token_ids) - 1
        for i, token_id in enumerate(out.new_token_ids):
            # Only a step's last token can be the one the core stopped on.
            text, hit_stop = detok.add_token(token_id, is_stop_token=stop_token and i == last)
            new_text += text
            # A stop string ends the request, unless the core ended it on this token for
            # length (a completed grammar does not stop it: the stop string's cut wins).
            if hit_stop and finish_reason != "length" and not stop_token:
                stopped_here = finish_reason is None
                finish_reason = "stop"
        if finish_reason is not None and not stop_token and not detok.stopped:
            new_text += detok.finish()  # the text held back while it might start a stop string
        new_logprobs = out.new_logprobs
        if state.logprobs is not None and new_logprobs:
            state.logprobs.extend(new_logprobs)
        finished = finish_reason is not None
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=detok.output_token_ids,
            text=detok.text,
            new_token_ids=list(out.new_token_ids),
            new_text=new_text,
            finished=finished,
            finish_reason=finish_reason,
            num_cached_tokens=out.num_cached_tokens,
            logprobs=state.logprobs,
            new_logprobs=new_logprobs,
            stop_string=detok.stop_string if finished else None,
        ), stopped_here
