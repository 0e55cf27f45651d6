"""The baseline: the OpenAI server a user would hack up around transformers' `generate`.

FastAPI, `/v1/completions` and `/v1/chat/completions` (streaming through
TextIteratorStreamer, which flushes whole words), greedy decoding, and one global lock, so
requests run one at a time: no batching, no KV cache beyond the one request's. It loads
the same weights as pagedserve (the default model's converted HF dir via engine.loader).

    python -m bench.naive_server [--model DIR|GGUF] [--dtype float32] [--port 8001] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from transformers import TextIteratorStreamer

from engine.config import EngineConfig
from engine.execution_plan import resolve_dtype
from engine.loader import load_reference_model, load_tokenizer, resolve_model_dir


@dataclass
class Generation:
    """One request's generation, run in a thread under the global lock."""

    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    output_ids: list[int] | None = None
    error: BaseException | None = None


class NaiveModel:
    def __init__(self, model: str | None, dtype: str = "auto") -> None:
        model_dir = resolve_model_dir(model)
        self.dtype = resolve_dtype(EngineConfig(dtype=dtype), torch.device("cpu"))
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_reference_model(model_dir, self.dtype)
        self.model.eval()
        self.max_model_len = int(self.model.config.max_position_embeddings)
        self.lock = threading.Lock()  # one request at a time: the naive part

    def generate(self, gen: Generation, streamer: TextIteratorStreamer | None) -> None:
        try:
            with self.lock, torch.inference_mode():
                ids = torch.tensor([gen.prompt_ids])
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=gen.max_tokens,
                    # ignore_eos: EOS is not allowed before max_tokens (transformers' way).
                    min_new_tokens=gen.max_tokens if gen.ignore_eos else None,
                    do_sample=False,
                    streamer=streamer,
                    pad_token_id=self.tokenizer.eos_token_id,
                )
            gen.output_ids = out[0, len(gen.prompt_ids) :].tolist()
        except BaseException as exc:  # reported to the client, never lost in the thread
            gen.error = exc
            if streamer is not None:
                streamer.end()


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return JSONResponse({"error": body}, status_code=status)


def _usage(gen: Generation) -> dict[str, int]:
    n_out = len(gen.output_ids or [])
    n_in = len(gen.prompt_ids)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def build_app(naive: NaiveModel, served_model_name: str) -> FastAPI:
    app = FastAPI(title="naive transformers server")
    tokenizer = naive.tokenizer

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": served_model_name, "object": "model", "owned_by": "naive"}
        return JSONResponse({"object": "list", "data": [card]})

    async def handle(raw: Request, chat: bool) -> Response:
        try:
            body = await raw.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if body.get("model") not in (None, served_model_name):
            return _error(404, f"The model `{body['model']}` does not exist.", "model")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "max_tokens must be a positive integer", "max_tokens")
        if chat:
            messages = body.get("messages") or []
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                return _error(400, "prompt must be a string", "prompt")
        prompt_ids = tokenizer.encode(text, add_special_tokens=not chat)
        if len(prompt_ids) + max_tokens > naive.max_model_len:
            return _error(400, f"prompt + max_tokens exceeds {naive.max_model_len} tokens")
        gen = Generation(prompt_ids, max_tokens, bool(body.get("ignore_eos")))
        view = _View(chat, served_model_name)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                _stream(naive, gen, view, include_usage), media_type="text/event-stream"
            )
        await asyncio.to_thread(naive.generate, gen, None)
        if gen.error is not None:
            return _error(500, f"generation failed: {gen.error}")
        answer = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
        return JSONResponse(view.response(answer, _finish(gen), _usage(gen)))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await handle(raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await handle(raw, chat=True)

    return app


def _finish(gen: Generation) -> str:
    return "length" if len(gen.output_ids or []) >= gen.max_tokens else "stop"


class _View:
    """Completion or chat JSON shapes."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _base(self, suffix: str = "") -> dict[str, Any]:
        obj = self.object + suffix
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        return {**self._base(), "choices": [{**choice, "finish_reason": finish}], "usage": usage}

    def chunk(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
        return {**self._base(".chunk" if self.chat else ""), "choices": [
            {**choice, "finish_reason": finish}]}  # fmt: skip


async def _stream(
    naive: NaiveModel, gen: Generation, view: _View, include_usage: bool
) -> AsyncIterator[str]:
    streamer = TextIteratorStreamer(naive.tokenizer, skip_prompt=True, skip_special_tokens=True)
    worker = threading.Thread(target=naive.generate, args=(gen, streamer), daemon=True)
    worker.start()
    pieces: Iterator[str] = iter(streamer)
    while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
        if piece:
            yield f"data: {json.dumps(view.chunk(piece))}\n\n"
    await asyncio.to_thread(worker.join)
    if gen.error is not None:
        error = {"message": f"generation failed: {gen.error}", "type": "server_error"}
        yield f"data: {json.dumps({'error': error})}\n\n"
    else:
        yield f"data: {json.dumps(view.chunk(None, _finish(gen)))}\n\n"
        if include_usage:
            yield f"data: {json.dumps({**view._base(), 'choices': [], 'usage': _usage(gen)})}\n\n"
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.naive_server", description=__doc__)
    parser.add_argument("--model", help="HF dir or .gguf (default: the embedded default model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--served-model-name")
    parser.add_argument("--threads", type=int,
                        help="torch threads (default: torch's). On a shared machine 1 avoids "
                        "OpenMP stalls when another process holds a core")  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    naive = NaiveModel(args.model, args.dtype)
    name = args.served_model_name or EngineConfig(model=args.model).served_name()
    print(f"naive server: {name}, dtype {naive.dtype}, http://{args.host}:{args.port}", flush=True)
    # A stop must not wait for a queue of streams to drain one at a time.
    uvicorn.run(build_app(naive, name), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
