"""Errors raised by the coordinator::

CoordinatorError
├── StateError              the state dir is unreadable or inconsistent
├── PairingError            a pairing request or approval is refused
│   ├── WrongCodeError      the typed code is not the device's code
│   ├── RevokedError        the device was revoked
│   └── TooManyAttemptsError  too many wrong codes: approvals locked for a while (429)
├── AgentError              an agent could not be reached or refused a request
│   └── AgentRefusedError   it answered with an error (status and message kept)
├── DeployError             a deployment could not be planned, pushed or checked
│   ├── NoRoomError         a cut version's devices cannot take it as cut (offline, no room)
│   └── NoFitError          no plan of the model fits the devices' free memory
├── RollbackError           there is no earlier version to switch back to
├── RequestError            an inference request is malformed (4xx)
│   ├── UnknownModelError   no deployment has that model id (404)
│   ├── ContextLengthError  prompt plus requested tokens exceed the model's context (400)
│   ├── DimensionsError     embeddings ``dimensions`` the model cannot give (400)
│   ├── ShapeLimitError     larger than the planned shapes and cannot be cut into runs (413)
│   ├── DraftModelError     a draft model that cannot draft for the model (400)
│   ├── ModelFormatError    a deploy's file is neither ONNX nor GGUF (400)
│   └── UnsupportedModelError  a GGUF fedshard cannot serve, refused before anything is pushed
│       ├── UnsupportedArchitectureError  its architecture (400)
│       ├── UnsupportedTensorTypeError    one of its tensor types (400)
│       └── UnsupportedRopeScalingError   its rope scaling mode (400)
├── NotServableError        the model cannot be served right now (503)
│   ├── ChainBrokenError    a stage lost its link or its session state: retry on a new chain
│   ├── CapacityError       no room for a new generation session now (429, Retry-After)
│   └── UnavailableError    the devices left cannot hold the model (503, Retry-After)
└── ApiError                a client's call: the API answered otherwise than 200, or no answer

The HTTP API translates these at its boundary (see :mod:`coordinator.http.serving`); the
client of that API (:mod:`coordinator.client`) raises :class:`ApiError`.
"""

from __future__ import annotations

from protocols.errors import ControlErrorCode


class CoordinatorError(Exception):
    """Base class of every error raised by :mod:`coordinator`."""


class StateError(CoordinatorError):
    """The coordinator's state dir cannot be read or written as expected."""


class PairingError(CoordinatorError):
    """A pairing request or approval is refused."""


class WrongCodeError(PairingError):
    """The pairing code typed by the operator does not match the device's key."""


class RevokedError(PairingError):
    """The device has been revoked and is refused everywhere."""


class TooManyAttemptsError(PairingError):
    """Too many wrong pairing codes: approvals are locked for ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = max(0.0, float(retry_after_s))


class AgentError(CoordinatorError):
    """An agent could not be reached, presented the wrong certificate, or failed a request."""


class AgentRefusedError(AgentError):
    """An agent answered a control-plane request with an error reply."""

    def __init__(self, device: str, status: int, error: ControlErrorCode, message: str) -> None:
        super().__init__(f"{device} refused ({status} {error}): {message}")
        self.device = device
        self.status = status
        self.error = error


class DeployError(CoordinatorError):
    """A deployment could not be planned, split, pushed or health-checked."""


class NoRoomError(DeployError):
    """A version cut for named devices cannot be placed as cut: one of them is not online, or
    refused a segment for its memory budget. Planning the version afresh may still fit."""


class NoFitError(DeployError):
    """No plan of the model fits the memory the devices have free (with the operator's caps)."""


class RollbackError(CoordinatorError):
    """There is no earlier version that can be switched back to."""


class RequestError(CoordinatorError):
    """An inference request is malformed: wrong names, shapes, types or encoding."""


class UnknownModelError(RequestError):
    """No deployment serves the requested model id."""


class DraftModelError(RequestError):
    """A speculative-decoding draft model that is no decoder export or whose tokenizer is not
    the served model's."""


class ModelFormatError(RequestError):
    """A file given to deploy is neither an ONNX model nor a GGUF file."""


class UnsupportedModelError(RequestError):
    """A GGUF file fedshard cannot serve; ``what`` names the unsupported thing (an
    architecture, a tensor type, a rope scaling mode). Raised before anything is pushed."""

    def __init__(self, message: str, what: str = "") -> None:
        super().__init__(message)
        self.what = what


class UnsupportedArchitectureError(UnsupportedModelError):
    """The GGUF's ``general.architecture`` has no segment builder."""


class UnsupportedTensorTypeError(UnsupportedModelError):
    """A tensor of the GGUF is stored in a type no ONNX Runtime kernel mapping takes."""


class UnsupportedRopeScalingError(UnsupportedModelError):
    """The GGUF asks for a rope scaling mode the segment builder does not implement."""


class NotServableError(CoordinatorError):
    """The model is known but cannot be served now (no live version, chain broken)."""


class ContextLengthError(RequestError):
    """The prompt plus the tokens asked for do not fit the model's context window."""

    def __init__(self, max_context: int, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"this model's maximum context length is {max_context} tokens, but "
            f"{prompt_tokens + max_tokens} were requested ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion)"
        )
        self.max_context = max_context
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


class ShapeLimitError(RequestError):
    """A request is larger than the shapes its deployment was planned for (and cannot be cut
    into runs that fit: a sequence longer than planned, outputs without a batch axis)."""


class DimensionsError(RequestError):
    """Embeddings ``dimensions`` asks for a size the model cannot give."""


class ChainBrokenError(NotServableError):
    """An agent reported that the chain itself broke (a link to the next agent, or a session
    a stage no longer holds), not that the request was bad: retrying it on a re-planned chain
    (replaying a session's tokens) can succeed."""


class CapacityError(NotServableError):
    """No room for a new generation session now (KV memory or session slots are full).

    ``retry_after_s`` is the backend's estimate of when a retry may succeed.
    """

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = max(0.0, float(retry_after_s))


class UnavailableError(NotServableError):
    """A device of the model's plan was lost and the devices left cannot hold the model.

    ``retry_after_s`` is when the coordinator will next try to re-plan it.
    """

    def __init__(self, message: str, retry_after_s: float = 10.0) -> None:
        super().__init__(message)
        self.retry_after_s = max(0.0, float(retry_after_s))


class ApiError(CoordinatorError):
    """A call of the coordinator's API answered otherwise than 200 (``status`` and the reply's
    ``detail``), or got no answer at all (status 0, ``detail`` says why)."""

    def __init__(self, status: int, detail: object) -> None:
        super().__init__(f"{status or 'no connection'}: {detail}")
        self.status = status
        self.detail = detail
