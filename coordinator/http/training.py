"""The training-run routes of the HTTP API (bearer token, mounted under ``/v1``)::

    POST /v1/training/runs            {"rounds", "secure_aggregation", "dp", "rollout_every"?}
                                      -> {"run_id"}; 409 while another run is going
    GET  /v1/training/runs            -> {"runs": [RunStatus, ...]}, oldest first
    GET  /v1/training/runs/{run_id}   -> RunStatus: status, error, rounds so far, rollouts

The bodies are :mod:`protocols.training`'s frozen models. Runs are owned by a
:class:`~coordinator.training.manager.TrainingRuns`, which
this module stops when the app shuts down.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import APIRouter, FastAPI

from coordinator.training.manager import TrainingRuns
from protocols.training import RunList, RunStatus, TrainingRunCreated, TrainingRunRequest


def training_router(runs: TrainingRuns) -> APIRouter:
    """The ``/training/runs`` routes over ``runs``."""
    api = APIRouter(prefix="/training", tags=["training"])

    @api.post("/runs")
    async def start_run(body: TrainingRunRequest) -> TrainingRunCreated:
        return TrainingRunCreated(run_id=await runs.start(body))

    @api.get("/runs")
    def list_runs() -> RunList:
        return RunList(runs=runs.list())

    @api.get("/runs/{run_id}")
    def get_run(run_id: str) -> RunStatus:
        return runs.get(run_id)

    return api


def mount_training(app: FastAPI, v1: APIRouter, runs: TrainingRuns) -> None:
    """Add the training routes to ``v1`` (before it is included) and stop ``runs`` at shutdown."""
    v1.include_router(training_router(runs))
    app.router.lifespan_context = _closing(app.router.lifespan_context, runs)  # type: ignore[assignment]


def _closing(
    inner: Callable[[FastAPI], AbstractAsyncContextManager[object]], runs: TrainingRuns
) -> Callable[[FastAPI], AbstractAsyncContextManager[object]]:
    """The app's lifespan, then :meth:`TrainingRuns.close` when it ends."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[object]:
        async with inner(app) as state:
            try:
                yield state
            finally:
                await runs.close()

    return lifespan
