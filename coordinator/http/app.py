"""The coordinator's HTTP API (FastAPI): devices, pairing and models, behind a bearer token.

Every route needs ``Authorization: Bearer TOKEN``, checked with the body size before any body
is read (:mod:`coordinator.http.guard`); ``?token=`` is only for the console page's first load,
which needs no token itself. Errors come back as ``{"detail": ...}`` with a 4xx/5xx status,
never a stack trace.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, params, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from coordinator.console import install_console
from coordinator.console.stats import InferenceCounter
from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.console import mount_console_api
from coordinator.http.devices import devices_router
from coordinator.http.errors import install_error_handlers
from coordinator.http.guard import ApiGuard
from coordinator.http.metrics import RequestMeter, mount_metrics
from coordinator.http.openai import generation_router
from coordinator.http.openai_serving import openai_serving_router
from coordinator.http.serving import serving_router
from coordinator.http.timing import RequestTimer
from coordinator.http.training import mount_training
from coordinator.trust.pairing import Pairing
from protocols.base import FrozenModel
from protocols.constants import SOFTWARE_VERSION

if TYPE_CHECKING:
    from coordinator.generation.backend import ModelLookup
    from coordinator.generation.speculative import SpeculationStats
    from coordinator.http.serving import Serving
    from coordinator.training.manager import TrainingRuns
    from coordinator.transport.agent_client import AgentClient
    from coordinator.trust.delivery import TrustService


@dataclass(frozen=True)
class Services:
    """What the API serves from, built once at start."""

    token: str
    registry: DeviceRegistry
    pairing: Pairing
    trust: TrustService | None = None
    """Delivers grants and revocations to agents (absent in unit tests of the book alone)."""
    serving: Serving | None = None
    """Deployments, inference and embeddings (absent: ``/v1/models`` lists nothing)."""
    generation: ModelLookup | None = None
    """Decoder models for ``/v1/chat/completions`` and ``/v1/completions`` (absent: no routes)."""
    speculation: Callable[[str], SpeculationStats | None] | None = None
    """A decoder's speculative decoding counters by model id (the console shows them)."""
    speculation_off: Callable[[str], str | None] | None = None
    """Why a decoder's speculative decoding setting is not in effect (None: it is)."""
    agents: AgentClient | None = None
    """Control-plane client (the console reads the agents' metrics with it)."""
    state_dir: Path | None = None
    """The coordinator's state dir (the console reads deployed manifests from it)."""
    training: TrainingRuns | None = None
    """Federated fine-tuning runs (absent: no ``/v1/training`` routes)."""
    open_docs: bool = False
    """Serve the API's description without the token (``--open-docs``)."""


_BEARER = HTTPBearer(auto_error=False)


class ErrorBody(FrozenModel):
    """Every error reply: a message (or, for a malformed request, the validation errors), and
    the catalogue's code where the error has one (:mod:`coordinator.http.errors`)."""

    detail: str | list[dict[str, Any]]
    code: str | None = None


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "malformed body, or wrong tensor names, types or shapes"),
        (401, "no valid bearer token"),
        (403, "wrong pairing code, or a revoked device"),
        (404, "no such model, device or pairing request"),
        (409, "infeasible or failed deployment, nothing to roll back"),
        (411, "a body without a Content-Length"),
        (413, "a body over the route's size limit"),
        (429, "no room for a new generation session, or too many wrong pairing codes"),
        (502, "an agent failed"),
        (503, "not servable now (no live version, a device lost, a broken chain), with the reason"),
    )
}
"""Error statuses every ``/v1`` route may answer, documented in the OpenAPI schema."""


def create_app(services: Services) -> FastAPI:
    """The FastAPI application over ``services``."""
    app = FastAPI(title="fedshard coordinator", version=SOFTWARE_VERSION)
    app.add_middleware(ApiGuard, token=services.token, open_docs=services.open_docs)
    install_error_handlers(app)
    token = _token_dependency(services.token)
    v1 = APIRouter(prefix="/v1", dependencies=[token], responses=ERROR_RESPONSES)

    v1.include_router(devices_router(services))
    metrics = mount_metrics(app, services, token)
    v1.include_router(openai_serving_router(services.serving, metrics))
    if services.serving is not None:
        v1.include_router(serving_router(services.serving))
    stats = mount_console_api(v1, services)
    if services.training is not None:
        mount_training(app, v1, services.training)
    if services.generation is not None:
        v1.include_router(generation_router(services.generation, metrics))
    app.include_router(v1)
    install_console(app)
    meter = RequestMeter(metrics)
    # added last, so outermost: requests the guard refuses are timed too
    app.add_middleware(
        RequestTimer, observers=[meter, InferenceCounter(stats)], starts=[meter.start]
    )
    return app


def _token_dependency(token: str) -> params.Depends:
    def check(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        # ApiGuard already refused these before reading a body; kept for the OpenAPI schema
        given = credentials.credentials if credentials is not None else None
        if given is None or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "a valid bearer token is required",
                headers={"WWW-Authenticate": "Bearer"},
            )

    dependency: params.Depends = Depends(check)
    return dependency
