"""The routes of a server of several models: the model list with each model's state, and
loading and unloading by hand (the routes llama.cpp's router mode has: `POST /models/load`
and `POST /models/unload` with `{"model": NAME}`, `GET /models`).

`/v1/models` keeps OpenAI's shape and adds `status` to each card (its `value` as
llama-server reports it: loaded, loading, unloaded; also unloading and failed).
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from server.model_registry import ModelEntry
from server.model_router import ModelRouter
from server.openapi import responses
from server.output_schemas import ModelCard
from server.request_base import OpenAIBaseModel

StateName = Literal["unloaded", "loading", "loaded", "unloading", "failed"]


class ModelStatus(BaseModel):
    value: StateName
    error: str | None = Field(None, description="failed: why its load failed")
    default: bool = Field(False, description="the model of a request that names none")
    pinned: bool = Field(False, description="never unloaded (--pin)")
    memory_bytes: int = Field(description="its weight files + KV pool (estimated until "
                              "it has loaded): what it takes of --models-memory")  # fmt: skip
    load_seconds: float | None = Field(None, description="its last load's duration")


class RoutedModelCard(ModelCard):
    status: ModelStatus


class RoutedModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[RoutedModelCard]


class ModelActionRequest(OpenAIBaseModel):
    model: str = Field(min_length=1, max_length=1024)


class ModelActionResponse(BaseModel):
    success: bool = True
    model: RoutedModelCard


def model_card(router: ModelRouter, entry: ModelEntry) -> RoutedModelCard:
    client = entry.client
    return RoutedModelCard(
        id=entry.name,
        root=entry.path,
        max_model_len=client.max_model_len if client is not None else None,
        status=ModelStatus(
            value=entry.state.value,
            error=entry.error.message if entry.error is not None else None,
            default=entry is router.registry.default,
            pinned=entry.pinned,
            memory_bytes=entry.memory_bytes,
            load_seconds=entry.load_seconds,
        ),
    )


def model_list(router: ModelRouter) -> RoutedModelList:
    return RoutedModelList(data=[model_card(router, e) for e in router.registry])


def add_model_routes(app: FastAPI, router: ModelRouter) -> None:
    @app.get("/models", responses=responses(RoutedModelList, 401))
    async def models() -> Response:
        """Several models (--models-dir): /v1/models, at llama-server's router's path."""
        return JSONResponse(model_list(router).model_dump())

    @app.post("/models/load", responses=responses(ModelActionResponse, 400, 401, 404, 503))
    async def load(body: ModelActionRequest) -> Response:
        """Several models (--models-dir): load a model now (a failed one is tried again);
        answers once it is loaded."""
        entry = await router.load(body.model)
        return JSONResponse(ModelActionResponse(model=model_card(router, entry)).model_dump())

    @app.post("/models/unload", responses=responses(ModelActionResponse, 400, 401, 404))
    async def unload(body: ModelActionRequest) -> Response:
        """Several models (--models-dir): unload a model once its requests end; answers
        once it is unloaded."""
        entry = await router.unload(body.model)
        return JSONResponse(ModelActionResponse(model=model_card(router, entry)).model_dump())
