"""A model's chat template rendered for requests: under its bounds, on threads of its own.

The template is the model file's code (engine/template_bounds.py bounds each render: time,
the prompt's size, values, memory). Its deadline is checked cooperatively, so a render
must not run on the event loop, where even a bounded one would stall every other request
for as long: each model's `ChatRenderer` renders on `RENDER_THREADS` threads of its own,
and a template that misbehaves holds only those (other models render on theirs).

Past a bound, the request is answered in the OpenAI shape, blaming whoever made the render
large: a 400 when the request's own text is at least `BLAME_SHARE` of what the context
takes (send less), a 500 naming the model's template otherwise (a template that blew a
small request up is the model's fault, logged as a warning without a traceback).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

from engine.chat_template_check import chat_template_limits
from engine.template_bounds import DEFAULT_TIMEOUT_S, RenderLimits, TemplateBoundError
from server.errors import SERVER_ERROR, OpenAIError, bad_request
from server.tokens import apply_chat_template

logger = logging.getLogger(__name__)

# Threads each model renders on: renders hold the GIL, so more would not render faster;
# two let a normal request's render go on beside one that runs into its time bound.
RENDER_THREADS = 2
# A render past a bound is the request's doing when its own text is at least this share
# of the prompt's bound: a template writes a message out once or twice, not four times.
BLAME_SHARE = 0.25


class ChatRenderer:
    """``tokenizer``'s chat template under the bounds of a model of ``max_model_len`` tokens
    (engine/chat_template_check.py: the same the model was checked under at load)."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        model_name: str = "this model",
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._context = (max_model_len, timeout_s)
        self._limits: RenderLimits | None = None  # measured by the first render
        self._threads: ThreadPoolExecutor | None = None  # started by the first render

    @property
    def limits(self) -> RenderLimits:
        if self._limits is None:  # (the vocabulary's longest token: ~30 ms, once)
            self._limits = chat_template_limits(self.tokenizer, *self._context)
        return self._limits

    async def render(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text, rendered on this model's threads; an `OpenAIError` when the
        template refuses the messages (400) or a bound stops it (400 or 500)."""
        if self._threads is None:
            self._threads = ThreadPoolExecutor(RENDER_THREADS, "chat-template")
        render = functools.partial(self.render_now, conversation, add_generation_prompt,
                                   tools, template_kwargs)  # fmt: skip
        return await asyncio.get_running_loop().run_in_executor(self._threads, render)

    def render_now(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """`render` on the calling thread (start-up's pinned system prompts)."""
        try:
            return apply_chat_template(self.tokenizer, conversation, add_generation_prompt,
                                       tools, template_kwargs, self.limits)  # fmt: skip
        except TemplateBoundError as exc:
            own = _request_bytes(conversation, tools, template_kwargs)
            raise self.bound_error(exc, own) from None

    def bound_error(self, exc: TemplateBoundError, request_bytes: int) -> OpenAIError:
        """The answer to a render ``exc`` stopped, of a request whose own text (messages,
        tools, template variables) is ``request_bytes``."""
        bound = self.limits.max_prompt_bytes
        if request_bytes >= BLAME_SHARE * bound:
            return bad_request(
                f"The messages are too large for this model's chat template: {exc}. This "
                f"request's messages, tools and template variables are {request_bytes:,} "
                f"bytes; the model's context takes a prompt of at most {bound:,} bytes. "
                "Send less.",
                param="messages", code="chat_template_bound",
            )  # fmt: skip
        message = (f"The chat template of model {self.model_name} failed on this request: "
                   f"{exc} ({exc.bound} bound). The model's template is at fault, not the "
                   "request (docs/limits.md).")  # fmt: skip
        logger.warning("model %s: %s", self.model_name, message)
        return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, type=SERVER_ERROR,
                           code="chat_template_bound")  # fmt: skip

    def close(self) -> None:
        """Stop the threads once their renders end (a render ends within its time bound)."""
        if self._threads is not None:
            self._threads.shutdown(wait=False)


def _request_bytes(conversation: Any, tools: Any, template_kwargs: Any) -> int:
    """The request's own text, as UTF-8 JSON (rendered only on the way to an error)."""
    text = json.dumps([conversation, tools, template_kwargs], ensure_ascii=False, default=str)
    return len(text.encode("utf-8", "surrogatepass"))
