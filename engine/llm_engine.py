"""The offline engine: the engine core and the output processor on one thread.

`LLMEngine` is what `engine.LLM`, `pagedserve generate`, the benchmarks and the tests
drive: `add_request`, then `step()` until `has_unfinished_requests()` is False, each step
giving `RequestOutput`s with text. The server does not use it: it runs the `EngineCore`
on its engine thread (server/engine_loop.py) and the `OutputProcessor` on its event loop
(server/async_engine.py).
Not thread-safe: one thread calls everything. The core's facts and parts (tokenizer,
model, scheduler, stats...) are its own: `llm_engine.core.<name>`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import StepError
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from scheduler import SamplingParams


class LLMEngine:
    def __init__(
        self, config: EngineConfig, kv_event_listener: Callable[[Any], None] | None = None
    ) -> None:
        self.core = core = EngineCore.from_config(config, kv_event_listener)
        self.processor: OutputProcessor[None] = OutputProcessor(core.tokenizer)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        queue_timeout: float | None = None,
    ) -> None:
        """Queue a request (see `EngineCore.add_request`); ValueError when it can never run."""
        if request_id in self.processor:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.core.add_request(
            request_id, prompt_token_ids, params, cache_salt, priority, queue_timeout
        )
        self.processor.add_request(request_id, list(prompt_token_ids), params, None)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort in any state; the blocks are freed at once."""
        self.core.abort_requests(request_ids)
        self.processor.remove(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step of the core, its outputs processed; a stop string's request is aborted
        in the core before this returns. Raises `StepError` as `EngineCore.step` does (the
        failed requests are forgotten here too)."""
        try:
            core_outputs = self.core.step()
        except StepError as exc:
            self.processor.remove(exc.request_ids)
            raise
        processed = self.processor.process(core_outputs)
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        return [output for _, output in processed.outputs]

    def pin_prefix(self, token_ids: list[int]) -> int:
        return self.core.pin_prefix(token_ids)

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
