"""The coordinator's side of typed wire errors: an agent's :class:`WireErrorCode` to our errors.

:data:`REMOTE` is the one table. Bad input is the caller's fault (:class:`RequestError`, 400);
a full session table is :class:`CapacityError` (429 with Retry-After, as the error catalogue of
:mod:`coordinator.http.errors` answers it: the client backs off and retries); a broken link or
lost session state is :class:`ChainBrokenError` (retried on a re-planned chain); anything else
means the chain cannot serve now (:class:`NotServableError`, 503).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final

from coordinator.errors import (
    CapacityError,
    ChainBrokenError,
    CoordinatorError,
    NotServableError,
    RequestError,
    ShapeLimitError,
)
from protocols.errors import WireErrorCode
from protocols.frames import FrameHeader

SESSION_FULL_RETRY_S = 1.0


def _capacity(message: str) -> CoordinatorError:
    return CapacityError(message, SESSION_FULL_RETRY_S)


def _broken(message: str) -> CoordinatorError:
    return ChainBrokenError(f"the chain failed: {message}")


def _not_servable(message: str) -> CoordinatorError:
    return NotServableError(f"the chain failed: {message}")


REMOTE: Final[Mapping[WireErrorCode, Callable[[str], CoordinatorError]]] = {
    WireErrorCode.INPUT_MISMATCH: RequestError,
    WireErrorCode.EXECUTION_FAILED: RequestError,
    WireErrorCode.TENSOR_SPEC: RequestError,
    WireErrorCode.CONTEXT_LENGTH: RequestError,
    WireErrorCode.SHAPE_LIMIT: ShapeLimitError,
    WireErrorCode.SESSION_LIMIT: _capacity,
    WireErrorCode.LINK_DOWN: _broken,
    WireErrorCode.SESSION_STATE: _broken,
    WireErrorCode.REFUSED: _not_servable,
    WireErrorCode.BAD_FRAME: _not_servable,
    WireErrorCode.FRAME_TOO_LARGE: _not_servable,
    WireErrorCode.NO_SEGMENT: _not_servable,
    WireErrorCode.PEER_REJECTED: _not_servable,
    WireErrorCode.INTERNAL: _not_servable,
}
"""Every code an agent may send, to the coordinator error it becomes."""


def remote_error(header: FrameHeader) -> CoordinatorError:
    """The coordinator error for an agent's error frame."""
    code = header.error_code or WireErrorCode.INTERNAL
    return REMOTE[code](header.failure())
