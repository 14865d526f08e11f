"""The agent's side of typed wire errors: its exceptions to :class:`WireErrorCode` and back,
and to :class:`ControlErrorCode` for the control plane's replies.

An error frame carries ``kind="error"``, a code and the exception's message; the class name never
crosses the wire. :data:`CODES` is the data plane's one table (most specific first) and
:data:`CONTROL_CODES` the control plane's; :func:`error_header` turns a request's header into the
error frame that answers it.
"""

from __future__ import annotations

from typing import Final

from edge_agent.errors import (
    BudgetError,
    ContextLengthError,
    DeployError,
    ExecutionError,
    InputMismatchError,
    IntegrityError,
    LinkError,
    NoSegmentError,
    PairingError,
    PeerRejectedError,
    RemoteRequestError,
    RequestError,
    SegmentLoadError,
    SessionLimitError,
    SessionStateError,
    ShapeLimitError,
    SignatureError,
    StorageError,
    WrongTargetError,
)
from protocols.errors import (
    ControlErrorCode,
    FrameError,
    FrameTooLargeError,
    ProtocolError,
    TensorSpecError,
    WireErrorCode,
)
from protocols.frames import FrameHeader, FrameKind

MAX_MESSAGE: Final = 4096

CODES: Final[tuple[tuple[type[Exception], WireErrorCode], ...]] = (
    (InputMismatchError, WireErrorCode.INPUT_MISMATCH),
    (NoSegmentError, WireErrorCode.NO_SEGMENT),
    (ExecutionError, WireErrorCode.EXECUTION_FAILED),
    (SessionLimitError, WireErrorCode.SESSION_LIMIT),
    (SessionStateError, WireErrorCode.SESSION_STATE),
    (ContextLengthError, WireErrorCode.CONTEXT_LENGTH),
    (ShapeLimitError, WireErrorCode.SHAPE_LIMIT),
    (RequestError, WireErrorCode.REFUSED),
    (TensorSpecError, WireErrorCode.TENSOR_SPEC),
    (FrameTooLargeError, WireErrorCode.FRAME_TOO_LARGE),
    (FrameError, WireErrorCode.BAD_FRAME),
    (PeerRejectedError, WireErrorCode.PEER_REJECTED),
    (LinkError, WireErrorCode.LINK_DOWN),
)
"""Most specific first: the first class an exception is an instance of gives its code."""


def code_of(exc: BaseException) -> WireErrorCode:
    """The wire code for ``exc`` (:attr:`WireErrorCode.INTERNAL` for anything not listed)."""
    return next((code for kind, code in CODES if isinstance(exc, kind)), WireErrorCode.INTERNAL)


CONTROL_CODES: Final[tuple[tuple[type[Exception], ControlErrorCode], ...]] = (
    (IntegrityError, ControlErrorCode.INTEGRITY),
    (SignatureError, ControlErrorCode.SIGNATURE),
    (WrongTargetError, ControlErrorCode.WRONG_TARGET),
    (BudgetError, ControlErrorCode.OVER_BUDGET),
    (StorageError, ControlErrorCode.STORAGE),
    (SegmentLoadError, ControlErrorCode.SEGMENT_LOAD),
    (DeployError, ControlErrorCode.REFUSED),
    (PairingError, ControlErrorCode.PAIRING),
    (PeerRejectedError, ControlErrorCode.PEER_REJECTED),
    (ProtocolError, ControlErrorCode.BAD_REQUEST),
    (LinkError, ControlErrorCode.LINK_DOWN),
)
"""The control plane's table, most specific first, as :data:`CODES` is the data plane's."""


def control_code_of(exc: BaseException) -> ControlErrorCode:
    """The control-plane code for ``exc`` (:attr:`ControlErrorCode.REFUSED` if not listed)."""
    return next(
        (code for kind, code in CONTROL_CODES if isinstance(exc, kind)), ControlErrorCode.REFUSED
    )


def error_header(header: FrameHeader, exc: BaseException, **update: object) -> FrameHeader:
    """``header`` turned into the error frame that reports ``exc`` (``update`` applied too)."""
    fields = {"kind": FrameKind.ERROR, "error_code": code_of(exc), "error": _message(exc)}
    return header.model_copy(update={**fields, "tensors": [], **update})


def remote_error(header: FrameHeader) -> RemoteRequestError:
    """The requester's exception for an error frame it got back from the chain."""
    return RemoteRequestError(header.failure())


def _message(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:MAX_MESSAGE]
