"""The edge agent's errors, one hierarchy, translated at the boundary.

Errors from :mod:`protocols` (``ProtocolError``: bad frames, bad JSON) pass through unchanged;
everything the agent itself refuses raises one of these::

    AgentError
    ├── ConfigError            command line, state dir or key/certificate files are unusable
    ├── PeerRejectedError      a TLS peer has no certificate, the wrong name or the wrong role
    ├── DeployError            a segment is refused                      -> HTTP 4xx
    │   ├── IntegrityError     its bytes do not hash to the manifest's sha256
    │   ├── SignatureError     the coordinator's signature does not verify
    │   ├── WrongTargetError   the manifest is for another device, or the plan version is taken
    │   ├── BudgetError        predicted or measured memory over the agent's budget
    │   ├── StorageError       a training copy is larger than the agent's training storage
    │   └── SegmentLoadError   ONNX Runtime cannot load it or run the warm-up (malformed ONNX)
    ├── RequestError           a data-plane request is refused           -> error frame
    │   ├── InputMismatchError names, dtypes, ranks or fixed dims differ from the segment's inputs
    │   ├── NoSegmentError     no segment for that plan version and segment index
    │   ├── ExecutionError     ONNX Runtime failed while running the segment
    │   ├── SessionLimitError  no room for another session's state        -> 503 at the coordinator
    │   ├── SessionStateError  a step for an unknown session or the wrong position (replay)
    │   │   └── SessionRewindError a rewind to a position the session never held
    │   ├── ContextLengthError a session would grow past the planned context length
    │   ├── ShapeLimitError    a tensor is larger than the shapes the deployment was planned for
    │   └── RemoteRequestError a requester got an error frame back from the chain
    ├── LinkError              the next agent of the chain cannot be reached
    └── PairingError           a pairing grant does not fit this agent   -> HTTP 409

The boundaries: the control plane turns ``DeployError`` and ``ProtocolError`` into an
``ErrorReply`` with a 4xx status; the data plane turns ``RequestError`` and ``FrameError`` into an
error frame (and closes the connection when the stream can no longer be trusted); the CLI turns
``ConfigError`` into exit code 2.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class of every error the edge agent raises."""


class ConfigError(AgentError):
    """The configuration, state dir or identity files cannot be used."""


class PeerRejectedError(AgentError):
    """A TLS peer is not who the agent expects (name or role), or presented no certificate."""


class DeployError(AgentError):
    """A segment was refused."""

    http_status = 422


class IntegrityError(DeployError):
    """The segment bytes do not match the manifest's SHA-256."""

    http_status = 400


class SignatureError(DeployError):
    """The manifest's signature is missing, malformed or does not verify with the CA key."""

    http_status = 403


class WrongTargetError(DeployError):
    """The manifest names another device, or its plan version is already loaded."""

    http_status = 409


class BudgetError(DeployError):
    """The segment does not fit the agent's memory budget."""

    http_status = 507


class StorageError(DeployError):
    """A training copy (the version a run fine-tunes) does not fit the training storage."""

    http_status = 507


class SegmentLoadError(DeployError):
    """ONNX Runtime could not load the segment or run its warm-up."""


class RequestError(AgentError):
    """A data-plane request was refused."""


class InputMismatchError(RequestError):
    """A frame's tensors do not match the segment's declared inputs."""


class NoSegmentError(RequestError):
    """No loaded segment serves the frame's plan version and segment index."""


class ExecutionError(RequestError):
    """ONNX Runtime failed while running the segment."""


class SessionLimitError(RequestError):
    """Every session slot the plan reserved memory for is in use."""


class SessionStateError(RequestError):
    """A step names a session this stage does not hold, or the wrong position in it."""


class SessionRewindError(SessionStateError):
    """A rewind asks for a position the session never held (it can only be cut back)."""


class ContextLengthError(RequestError):
    """A session would hold more tokens than the deployment was planned for."""


class ShapeLimitError(RequestError):
    """A frame's batch or sequence is larger than the deployment was planned for."""


class LinkError(AgentError):
    """The next agent of the chain cannot be reached."""


class RemoteRequestError(RequestError):
    """The chain answered a request with an error frame (seen by a requester)."""


class PairingError(AgentError):
    """A pairing grant was refused (already paired, wrong key, name or issuer)."""

    http_status = 409
