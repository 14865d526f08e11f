"""One catalogue: every error an HTTP route can meet, to its status, OpenAI type/code, Retry-After.

:data:`CATALOGUE` is the only place an error class becomes an HTTP status. Both body styles are
rendered from the same entry, so every route family answers an error class with the same status:

- the core API (``/v1/devices``, ``/v1/pairing``, ``/v1/deployments``, ``/v1/infer``, the
  console and training routes): ``{"detail": message}``
  (:func:`detail_response`);
- the OpenAI routes (:data:`OPENAI_PATHS`: ``/v1/models``, ``/v1/models/{id}``,
  ``/v1/embeddings``, ``/v1/chat/completions``, ``/v1/completions``):
  ``{"error": {"message", "type", "param", "code"}}`` (:func:`openai_response`), so the official
  OpenAI SDK raises its own exception classes (``BadRequestError``, ``AuthenticationError``,
  ``NotFoundError``, ``RateLimitError``, ``InternalServerError``) with fedshard's message.

No room for a new generation session is 429 with ``Retry-After`` (the SDK's ``RateLimitError``,
which clients back off from, as from text-generation-inference's "model is overloaded"); a model
that cannot be served at all now is 503. A malformed request is 400 everywhere, whether pydantic
or the coordinator finds the fault. An error carrying ``retry_after_s`` gets a ``Retry-After``
header (whole seconds, at least 1). Anything that is not a coordinator error is 500 with a
fixed message: never a stack trace.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.errors import (
    AgentError,
    CapacityError,
    ContextLengthError,
    CoordinatorError,
    DeployError,
    DimensionsError,
    DraftModelError,
    ModelFormatError,
    NotServableError,
    PairingError,
    RequestError,
    RevokedError,
    RollbackError,
    ShapeLimitError,
    TooManyAttemptsError,
    UnavailableError,
    UnknownModelError,
    UnsupportedArchitectureError,
    UnsupportedModelError,
    UnsupportedRopeScalingError,
    UnsupportedTensorTypeError,
    WrongCodeError,
)
from coordinator.training.errors import (
    LoraTargetError,
    NoTrainingTargetError,
    RunConflictError,
    TrainingError,
    UnknownRunError,
)

log = logging.getLogger(__name__)

INVALID: Final = "invalid_request_error"
SERVER: Final = "server_error"
INTERNAL: Final = "internal error (see the coordinator log)"


@dataclass(frozen=True)
class HttpError:
    """How one error class is answered: status, OpenAI ``type``, ``code`` and ``param``."""

    status: int
    type: str
    code: str | None = None
    param: str | None = None


CATALOGUE: Final[tuple[tuple[type[CoordinatorError], HttpError], ...]] = (
    (UnknownModelError, HttpError(404, INVALID, "model_not_found", "model")),
    (ContextLengthError, HttpError(400, INVALID, "context_length_exceeded")),
    (DimensionsError, HttpError(400, INVALID, "unsupported_dimensions", "dimensions")),
    (ShapeLimitError, HttpError(413, INVALID, "shape_limit_exceeded")),
    (DraftModelError, HttpError(400, INVALID, "draft_model_mismatch", "draft_model")),
    (ModelFormatError, HttpError(400, INVALID, "unsupported_model_format", "model_path")),
    (UnsupportedArchitectureError, HttpError(400, INVALID, "unsupported_architecture")),
    (UnsupportedTensorTypeError, HttpError(400, INVALID, "unsupported_tensor_type")),
    (UnsupportedRopeScalingError, HttpError(400, INVALID, "unsupported_rope_scaling")),
    (UnsupportedModelError, HttpError(400, INVALID, "unsupported_model")),
    (RequestError, HttpError(400, INVALID)),
    (WrongCodeError, HttpError(403, INVALID, "wrong_pairing_code")),
    (RevokedError, HttpError(403, INVALID, "device_revoked")),
    (TooManyAttemptsError, HttpError(429, INVALID, "too_many_attempts")),
    (PairingError, HttpError(404, INVALID, "unknown_device")),
    (RollbackError, HttpError(409, INVALID, "nothing_to_roll_back")),
    (CapacityError, HttpError(429, "requests", "overloaded")),
    (UnavailableError, HttpError(503, SERVER, "model_unavailable")),
    (NotServableError, HttpError(503, SERVER, "model_not_servable")),
    (DeployError, HttpError(409, INVALID, "deploy_failed")),
    (AgentError, HttpError(502, SERVER, "backend_error")),
    (RunConflictError, HttpError(409, INVALID, "training_run_conflict")),
    (UnknownRunError, HttpError(404, INVALID, "training_run_not_found")),
    (NoTrainingTargetError, HttpError(409, INVALID, "no_training_target")),
    (LoraTargetError, HttpError(400, INVALID, "model_not_trainable", "model")),
    (TrainingError, HttpError(500, SERVER, "training_failed")),
    (CoordinatorError, HttpError(500, SERVER)),
)
"""Most specific first: the first class ``exc`` is an instance of decides."""

OPENAI_PATHS: Final = frozenset(
    {"/v1/models", "/v1/embeddings", "/v1/chat/completions", "/v1/completions"}
)
"""The routes that mirror OpenAI's API (and ``/v1/models/{id}``): OpenAI error bodies."""

MALFORMED: Final = HttpError(400, INVALID)
UNEXPECTED: Final = HttpError(500, SERVER)


@dataclass(frozen=True)
class Rendered:
    """An error as both body styles need it: entry, message, param and headers."""

    entry: HttpError
    message: str
    param: str | None
    headers: dict[str, str]


def entry_of(exc: BaseException) -> HttpError:
    """The catalogue entry for a coordinator error (500 for anything not listed)."""
    return next((entry for kind, entry in CATALOGUE if isinstance(exc, kind)), UNEXPECTED)


def render(exc: BaseException) -> Rendered:
    """Status, message and headers for any exception a route raised."""
    if isinstance(exc, RequestValidationError):
        message, param = validation_message(exc.errors())
        return Rendered(MALFORMED, message, param, {})
    if isinstance(exc, StarletteHTTPException):  # FastAPI's, or Starlette's (a body not UTF-8)
        code = "invalid_api_key" if exc.status_code == 401 else None
        entry = HttpError(exc.status_code, INVALID, code)
        return Rendered(entry, str(exc.detail), None, dict(exc.headers or {}))
    if not isinstance(exc, CoordinatorError):
        return Rendered(UNEXPECTED, INTERNAL, None, {})
    entry = entry_of(exc)
    headers: dict[str, str] = {}
    retry_after_s = getattr(exc, "retry_after_s", None)
    if isinstance(retry_after_s, float | int):
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return Rendered(entry, str(exc), entry.param, headers)


def openai_body(rendered: Rendered) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``."""
    entry = rendered.entry
    detail = {"message": rendered.message, "type": entry.type, "param": rendered.param}
    return {"error": {**detail, "code": entry.code}}


def openai_response(exc: BaseException, path: str) -> JSONResponse:
    """The OpenAI-style answer to ``exc`` (logged; 5xx at error level)."""
    rendered = _logged(exc, path)
    return JSONResponse(
        openai_body(rendered), status_code=rendered.entry.status, headers=rendered.headers
    )


def detail_response(exc: BaseException, path: str) -> JSONResponse:
    """The core-API answer to ``exc``: ``{"detail": message}``, plus ``"code"`` where the
    catalogue names one (logged; 5xx at error level)."""
    rendered = _logged(exc, path)
    body = {"detail": rendered.message}
    if rendered.entry.code is not None:
        body["code"] = rendered.entry.code
    return JSONResponse(body, status_code=rendered.entry.status, headers=rendered.headers)


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is an OpenAI route (its errors are ``{"error": {...}}``)."""
    return path in OPENAI_PATHS or path.startswith("/v1/models/")


def error_json(path: str, status: int, message: str) -> dict[str, Any]:
    """The error body for ``path`` in its family's style, for answers made outside a route
    (an ASGI guard that refuses a request before routing): OpenAI's or ``{"detail"}``."""
    if not is_openai_path(path):
        return {"detail": message}
    code = "invalid_api_key" if status == 401 else None
    kind = SERVER if status >= 500 else INVALID
    return openai_body(Rendered(HttpError(status, kind, code), message, None, {}))


class OpenAIErrorRoute(APIRoute):
    """A route whose every error (auth, validation, coordinator, unexpected) is OpenAI-shaped."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The normal handler, with errors turned into OpenAI error responses."""
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # the API boundary: logged and translated, never leaked
                return openai_response(exc, request.url.path)

        return guarded


def install_error_handlers(app: FastAPI) -> None:
    """Core-API errors become ``{"detail": message}`` with their catalogue status."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return detail_response(exc, request.url.path)

    app.add_exception_handler(CoordinatorError, handle)
    app.add_exception_handler(RequestValidationError, handle)
    app.add_exception_handler(Exception, handle)


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A one-line message and the offending parameter from pydantic's error list."""
    parts: list[str] = []
    param: str | None = None
    for error in errors[:5]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        message = str(error.get("msg", "invalid value"))
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts) or "malformed request body", param


def _logged(exc: BaseException, path: str) -> Rendered:
    rendered = render(exc)
    if rendered.entry.status >= 500:
        log.error("%s: %s", path, exc, exc_info=not isinstance(exc, CoordinatorError))
    else:
        log.info("%s: %s %s", path, rendered.entry.status, rendered.message)
    return rendered
