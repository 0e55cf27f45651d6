"""The offline API: `LLM().generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from scheduler import SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs prompts to completion through the same engine the server uses."""

    def __init__(self, model: str | None = None, **fields) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **fields))
        self.tokenizer = self.engine.core.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        ids = [self._add(p, sp) for p, sp in zip(prompts, params, strict=True)]
        return self._run(ids, use_tqdm and len(ids) > 1)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Conversations (lists of {"role", "content"}) through the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    def _add(self, prompt: Prompt, params: SamplingParams) -> str:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = f"offline-{self._counter}"
        self._counter += 1
        self.engine.add_request(request_id, token_ids, params)
        return request_id

    def _run(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="generate", disable=not show_progress) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
