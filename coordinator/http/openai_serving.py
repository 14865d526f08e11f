"""OpenAI-compatible models and embeddings routes (mounted under the token-protected ``/v1``)::

    GET  /v1/models          every deployed model with a live version (``models.list``)
    GET  /v1/models/{id}     one of them (``models.retrieve``); 404 ``model_not_found``
    POST /v1/embeddings      ``embeddings.create``

``/v1/embeddings`` takes ``input`` as a string, a list of strings, token ids (a list of ints)
or a list of token-id lists (ids of the model's own tokenizer, used as given);
``encoding_format`` ``"float"`` (the default) or ``"base64"`` (each vector's little-endian
float32 bytes, base64-encoded, which the official SDK asks for by default); ``dimensions`` only
at the model's native size (see :mod:`coordinator.serving.embeddings`); ``user`` is accepted
and ignored. Any other field is refused. Every error is OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` with the catalogue's status.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from coordinator.deploy.store import ModelRecord
from coordinator.errors import UnknownModelError
from coordinator.http.errors import OpenAIErrorRoute
from coordinator.http.metrics import CoordinatorMetrics, notes
from coordinator.http.openai_models import ERROR_RESPONSES

if TYPE_CHECKING:
    from coordinator.http.serving import Serving

MODEL_VERSION_HEADER = "X-Fedshard-Version"
"""Response header naming the version that served an embeddings request: the model's number."""
VERSION_HEADER = "X-Fedshard-Plan-Version"
"""The same version's plan version (the agents' key for it)."""
MAX_DIMENSIONS = 1 << 16


class EmbeddingsBody(BaseModel):
    """OpenAI ``POST /v1/embeddings``; ``null`` means the default for every optional field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1, le=MAX_DIMENSIONS)
    user: str | None = Field(default=None, max_length=256)

    def inputs(self) -> list[str | list[int]]:
        """One entry per vector asked for: texts, or token-id lists."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [[int(t) for t in self.input]]  # one input as token ids
        return list(self.input)  # type: ignore[arg-type]  # list[str] or list[list[int]]


def encode_vector(vector: np.ndarray[Any, Any], encoding: str | None) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    values = np.asarray(vector, dtype="<f4")
    if encoding == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    floats: list[float] = values.tolist()
    return floats


def openai_model(record: ModelRecord) -> dict[str, Any]:
    """An OpenAI model object for a deployed model; one served from a GGUF file also carries
    ``gguf``: the file's own name, architecture, parameter count and quantization mix."""
    live = record.version(record.active) if record.active else None
    created = int(live.created_at) if live else 0
    model = {"id": record.model_id, "object": "model", "created": created, "owned_by": "fedshard"}
    if live is not None and live.card is not None:  # a GGUF file: what it is
        model["gguf"] = live.card.model_dump(exclude={"build"})
    return model


def openai_serving_router(
    serving: Serving | None, metrics: CoordinatorMetrics | None = None
) -> APIRouter:
    """Models (and, with ``serving``, embeddings), OpenAI errors, counted into ``metrics``."""
    api = APIRouter(route_class=OpenAIErrorRoute, responses=ERROR_RESPONSES)

    def live_models() -> list[ModelRecord]:
        if serving is None:
            return []
        return [m for m in serving.store.book().models if m.active is not None]

    @api.get("/models")
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [openai_model(m) for m in live_models()]}

    @api.get("/models/{model_id}")
    def retrieve_model(model_id: str) -> dict[str, Any]:
        found = next((m for m in live_models() if m.model_id == model_id), None)
        if found is None:
            raise UnknownModelError(f"the model {model_id!r} does not exist")
        return openai_model(found)

    if serving is None:
        return api

    @api.post("/embeddings")
    async def embeddings(body: EmbeddingsBody, request: Request, response: Response) -> Any:
        serving.store.model(body.model)  # 404 for an unknown model before anything else
        notes(request).model = body.model
        version, vectors, tokens = await run_in_threadpool(
            serving.embedder.embed, body.model, body.inputs(), body.dimensions
        )
        if metrics is not None:
            metrics.input_tokens.labels(body.model).inc(tokens)
        response.headers[MODEL_VERSION_HEADER] = str(version.version)
        response.headers[VERSION_HEADER] = str(version.plan_version)
        data = [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "model": body.model, "data": data, "usage": usage}

    return api
