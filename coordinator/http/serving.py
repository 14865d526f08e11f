"""The serving half of the HTTP API: deployments, models, inference and embeddings.

Routes (bearer token, see :mod:`coordinator.http.app`)::

    GET  /v1/deployments                       versions, plan next to what agents measured
    POST /v1/deployments                       deploy an ONNX or GGUF file (plan, split, push,
                                               check)
    POST /v1/deployments/{model}/rollback      switch back to the previous version
    POST /v1/infer                             named tensors as JSON, or a raw .npz body
    GET  /v1/links, POST /v1/links/measure     measured links between paired agents
    GET  /v1/links/requester                   measured links from the coordinator to them
    GET  /v1/failover                          lost/returned devices, re-plans, refused models

Coordinator errors are translated into HTTP statuses by :mod:`coordinator.http.errors`. The
OpenAI-compatible ``/v1/models`` and ``/v1/embeddings`` live in
:mod:`coordinator.http.openai_serving`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from coordinator.deploy.cutting import DeployCommand
from coordinator.deploy.deployer import Deployer
from coordinator.deploy.store import DeploymentStore, ModelRecord, VersionRecord
from coordinator.errors import (
    DraftModelError,
    RequestError,
)
from coordinator.fleet.links import LinkMeter
from coordinator.generation.draft_model import check_draft_model
from coordinator.generation.speculative import Speculative
from coordinator.http.metrics import notes
from coordinator.http.npz import load_npz
from coordinator.serving.embeddings import Embedder, default_tokenizer_dir
from coordinator.serving.failover import Failover
from coordinator.serving.router import Router
from partitioner.planning.baselines import Baseline
from protocols.gguf_card import WeightsMode
from protocols.links import Link as DeviceLink
from protocols.links import RequesterLink
from protocols.plan import Objective

log = logging.getLogger(__name__)
MAX_NPZ_BYTES = 256 << 20


@dataclass(frozen=True)
class Serving:
    """What the serving routes use, built once at start."""

    store: DeploymentStore
    deployer: Deployer
    router: Router
    embedder: Embedder
    links: LinkMeter
    failover: Failover | None = None
    """Re-plans after a device loss (absent: chain failures are only retried)."""


class Body(BaseModel):
    """Request bodies: unknown fields refused."""

    model_config = ConfigDict(extra="forbid")


class DeployBody(Body):
    """``POST /v1/deployments``."""

    model_path: str = Field(min_length=1, description="ONNX or GGUF file on the coordinator's host")
    model_id: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    objective: Objective = Objective.THROUGHPUT
    memory_caps: dict[str, int] = Field(default_factory=dict)
    """Per-device planning caps in bytes (the operator's headroom)."""
    tokenizer_dir: str | None = None
    baseline: Baseline | None = None
    """Cut the way a baseline does (``exo``, ``even``) instead of planning: for comparisons."""
    speculative: Speculative | None = None
    """A decoder's speculative decoding (``off|lookup|draft|auto``; default: kept, or ``auto``
    for a new model)."""
    draft_model: str | None = Field(default=None, min_length=1)
    """Export directory of a draft model with the same tokenizer (``draft`` and ``auto``)."""
    weights: WeightsMode = "keep"
    """A GGUF file's weights in its segments: its own types (``keep``), or ``int4``/``int8``."""


class SpeculativeBody(Body):
    """``PUT /v1/deployments/{model_id}/speculative``."""

    speculative: Speculative
    draft_model: str | None = Field(default=None, min_length=1)


class InferBody(Body):
    """``POST /v1/infer`` as JSON: tensors as nested lists, by input name."""

    model: str
    inputs: dict[str, Any]


def _model_path(text: str) -> Path:
    """The absolute path of a model file named in a request; RequestError if it cannot be one."""
    try:
        return Path(text).expanduser().resolve()
    except (ValueError, RuntimeError, OSError) as exc:  # NUL bytes, ~unknown-user, loops
        raise RequestError(f"model_path is not a usable path: {exc}") from exc


def model_id_of(path: Path) -> str:
    """Default model id from a file name: ``all-MiniLM-L6-v2.onnx`` -> ``all-minilm-l6-v2``."""
    stem = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in path.stem.lower())
    return stem.strip("-._")[:63] or "model"


def serving_router(serving: Serving) -> APIRouter:
    """The serving routes (mounted under the token-protected ``/v1``)."""
    api = APIRouter()
    _deployment_routes(api, serving)
    _fleet_routes(api, serving)
    _inference_routes(api, serving)
    return api


def _deployment_routes(api: APIRouter, serving: Serving) -> None:
    @api.get("/deployments")
    def list_deployments() -> list[ModelRecord]:
        return serving.store.book().models

    @api.post("/deployments")
    async def deploy(body: DeployBody) -> VersionRecord:
        path = _model_path(body.model_path)
        model_id = body.model_id or model_id_of(path)
        tokenizer_dir = body.tokenizer_dir or default_tokenizer_dir(model_id)
        draft = str(_model_path(body.draft_model)) if body.draft_model else None
        if draft is not None:  # refused before the minutes a deployment takes
            if tokenizer_dir is None:
                raise DraftModelError("a draft model needs the served model's tokenizer_dir")
            await run_in_threadpool(check_draft_model, Path(draft), Path(tokenizer_dir))
        command = DeployCommand(
            model_path=path,
            model_id=model_id,
            objective=body.objective,
            memory_caps=body.memory_caps,
            tokenizer_dir=tokenizer_dir,
            baseline=body.baseline,
            weights=body.weights,
        )
        version = await run_in_threadpool(serving.deployer.deploy, command)
        if body.speculative is not None or draft is not None:
            mode = body.speculative or serving.store.model(model_id).speculative
            await run_in_threadpool(serving.store.set_speculative, model_id, mode, draft)
        return version

    @api.put("/deployments/{model_id}/speculative")
    def set_speculative(model_id: str, body: SpeculativeBody) -> ModelRecord:
        draft = str(_model_path(body.draft_model)) if body.draft_model else None
        return serving.store.set_speculative(model_id, body.speculative, draft)

    @api.post("/deployments/{model_id}/rollback")
    async def rollback(model_id: str) -> VersionRecord:
        return await run_in_threadpool(serving.deployer.rollback, model_id)


def _fleet_routes(api: APIRouter, serving: Serving) -> None:
    @api.get("/links")
    def links() -> list[DeviceLink]:
        return serving.links.links()

    @api.get("/links/requester")
    def requester_links() -> list[RequesterLink]:
        return serving.links.requester_links()

    @api.post("/links/measure")
    async def measure_links() -> list[DeviceLink]:
        return await run_in_threadpool(serving.links.measure)

    @api.get("/failover")
    def failover() -> dict[str, Any]:
        if serving.failover is None:
            return {"enabled": False, "models": {}, "events": []}
        conditions = {
            model_id: {
                "state": c.state,
                "version": c.version,
                "plan_version": c.plan_version,
                "reason": c.reason,
            }
            for model_id, c in serving.failover.conditions().items()
        }
        events = [e.model_dump() for e in serving.failover.events()]
        return {"enabled": True, "models": conditions, "events": events}


def _inference_routes(api: APIRouter, serving: Serving) -> None:
    @api.post("/infer")
    async def infer(request: Request) -> dict[str, Any]:
        """Run a deployed model on named input tensors.

        The body is `{"model": ID, "inputs": {NAME: nested list}}`, or a raw `.npz` file
        (`Content-Type: application/x-npz`, `?model=ID`; loaded without pickle). The answer is
        `{"model": ID, "version": N, "plan_version": P, "outputs": {NAME: {"dtype": "float32",
        "shape": [..], "data": nested list}}}`: every model output by name, computed whole by
        one version (``version``: the model's version number; ``plan_version``: the agents' key
        for it).
        """
        model_id, tensors = await _infer_request(request)
        serving.store.model(model_id)  # 404 for an unknown model
        notes(request).model = model_id
        version, outputs = await run_in_threadpool(serving.router.infer, model_id, tensors)
        return {
            "model": model_id,
            "version": version.version,
            "plan_version": version.plan_version,
            "outputs": {name: _tensor_json(array) for name, array in outputs.items()},
        }


async def _infer_request(request: Request) -> tuple[str, dict[str, Any]]:
    """Model id and tensors from a JSON body, or from a raw ``.npz`` body (``?model=``)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip()
    body = await request.body()
    if kind in {"application/x-npz", "application/octet-stream"}:
        model_id = request.query_params.get("model")
        if not model_id:
            raise RequestError("an .npz body needs the model id as ?model=")
        return model_id, _load_npz(body)
    try:
        parsed = InferBody.model_validate_json(body)
    except ValueError as exc:
        raise RequestError(f"malformed request body: {_first_line(exc)}") from exc
    return parsed.model, parsed.inputs


def _load_npz(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_NPZ_BYTES:
        raise RequestError(f"the .npz body is over {MAX_NPZ_BYTES} bytes")
    return load_npz(data)


def _tensor_json(array: np.ndarray[Any, Any]) -> dict[str, Any]:
    return {"dtype": str(array.dtype), "shape": list(array.shape), "data": array.tolist()}


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
