"""The coordinator's HTTP API (FastAPI): devices, pairing and models, behind a bearer token.

Every route needs ``Authorization: Bearer TOKEN``, checked with the body size before any body
is read (:mod:`coordinator.http.guard`); ``?token=`` is only for the console page's first load,
which needs no token itself. Errors come back as ``{"detail": ...}`` with a 4xx/5xx status,
never a stack trace.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, params, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict

from coordinator.errors import PairingError, RevokedError, TooManyAttemptsError, WrongCodeError
from coordinator.fleet.registry import DeviceRegistry
from coordinator.http.guard import ApiGuard
from coordinator.trust.pairing import Pairing, PairingBook
from protocols.constants import SOFTWARE_VERSION
from protocols.profile import Announcement

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
    agents: AgentClient | None = None
    """Control-plane client (the console reads the agents' metrics with it)."""
    state_dir: Path | None = None
    """The coordinator's state dir (the console reads deployed manifests from it)."""
    training: TrainingRuns | None = None
    """Federated fine-tuning runs (absent: no ``/v1/training`` routes)."""


_BEARER = HTTPBearer(auto_error=False)


class ApiModel(BaseModel):
    """Request and response bodies: frozen, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class DeviceView(ApiModel):
    """One device as the API shows it."""

    name: str
    fingerprint: str
    host: str
    online: bool
    status: str
    """``paired``, ``unpaired``, ``revoked`` or ``impostor``."""
    announcement: Announcement


class ErrorBody(ApiModel):
    """Every error reply: a message (or, for a malformed request, the validation errors)."""

    detail: str | list[dict[str, Any]]


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
        (429, "too many wrong pairing codes (see Retry-After)"),
        (502, "an agent failed"),
        (503, "not servable now, with the reason"),
    )
}
"""Error statuses every ``/v1`` route may answer, documented in the OpenAPI schema."""


class ApproveBody(ApiModel):
    """``POST /v1/pairing/approve``."""

    name: str
    code: str


class RevokeBody(ApiModel):
    """``POST /v1/pairing/revoke``."""

    name: str


def create_app(services: Services) -> FastAPI:
    """The FastAPI application over ``services``."""
    from coordinator.console import install_console
    from coordinator.http.console import mount_console_api
    from coordinator.http.errors import install_error_handlers
    from coordinator.http.metrics import mount_metrics
    from coordinator.http.openai_serving import openai_serving_router
    from coordinator.http.serving import serving_router

    app = FastAPI(title="fedshard coordinator", version=SOFTWARE_VERSION)
    app.add_middleware(ApiGuard, token=services.token)
    install_error_handlers(app)
    token = _token_dependency(services.token)
    v1 = APIRouter(prefix="/v1", dependencies=[token], responses=ERROR_RESPONSES)

    @v1.get("/devices")
    def list_devices() -> list[DeviceView]:
        book = services.pairing.book()
        return [
            DeviceView(
                name=r.name,
                fingerprint=r.fingerprint,
                host=r.host,
                online=r.online,
                status=device_status(book, r.name, r.fingerprint, r.impostor_of),
                announcement=r.announcement,
            )
            for r in services.registry.devices(online_only=False)
        ]

    @v1.get("/pairing")
    def pairing_book() -> PairingBook:
        return services.pairing.book()

    @v1.post("/pairing/approve")
    def approve(body: ApproveBody) -> dict[str, str]:
        try:
            if services.trust is not None:
                device = services.trust.approve(body.name, body.code)
            else:
                device = services.pairing.approve(body.name, body.code)
        except TooManyAttemptsError as exc:
            retry_after = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
            raise HTTPException(
                status.HTTP_429_TOO_MANY_REQUESTS, str(exc), headers=retry_after
            ) from exc
        except WrongCodeError as exc:
            raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from exc
        except RevokedError as exc:
            raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from exc
        except PairingError as exc:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
        return {"name": device.name, "fingerprint": device.fingerprint}

    @v1.post("/pairing/revoke")
    def revoke(body: RevokeBody) -> dict[str, str | list[str]]:
        told: list[str] = []
        try:
            if services.trust is not None:
                told = services.trust.revoke(body.name)
            else:
                services.pairing.revoke(body.name)
        except PairingError as exc:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from exc
        return {"revoked": body.name, "agents_told": told}

    metrics = mount_metrics(app, services, token)
    v1.include_router(openai_serving_router(services.serving, metrics))
    if services.serving is not None:
        v1.include_router(serving_router(services.serving))
    mount_console_api(app, v1, services)
    if services.training is not None:
        from coordinator.http.training import mount_training

        mount_training(app, v1, services.training)
    if services.generation is not None:
        from coordinator.http.openai import generation_router

        v1.include_router(generation_router(services.generation, metrics))
    app.include_router(v1)
    install_console(app)
    return app


def device_status(book: PairingBook, name: str, fingerprint: str, impostor_of: str | None) -> str:
    """``revoked``, ``paired``, ``impostor`` or ``unpaired``."""
    if fingerprint in book.revoked_fingerprints or name in book.revoked_names:
        return "revoked"
    if any(
        d.name == name and fingerprint in (d.fingerprint, d.previous_fingerprint)
        for d in book.paired
    ):
        return "paired"
    if impostor_of is not None or any(d.name == name for d in book.paired):
        return "impostor"
    return "unpaired"


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
