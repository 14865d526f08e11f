"""Errors raised by the coordinator::

CoordinatorError
├── StateError              the state dir is unreadable or inconsistent
├── PairingError            a pairing request or approval is refused
│   ├── WrongCodeError      the typed code is not the device's code
│   └── RevokedError        the device was revoked
├── AgentError              an agent could not be reached or refused a request
│   └── AgentRefusedError   it answered with an error (status and message kept)
├── DeployError             a deployment could not be planned, pushed or checked
├── RollbackError           there is no earlier version to switch back to
├── RequestError            an inference request is malformed (4xx)
│   └── UnknownModelError   no deployment has that model id (404)
└── NotServableError        the model cannot be served right now (503)

The HTTP API translates these at its boundary (see :mod:`coordinator.api_serving`).
"""

from __future__ import annotations


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


class AgentError(CoordinatorError):
    """An agent could not be reached, presented the wrong certificate, or failed a request."""


class AgentRefusedError(AgentError):
    """An agent answered a control-plane request with an error reply."""

    def __init__(self, device: str, status: int, error: str, message: str) -> None:
        super().__init__(f"{device} refused ({status} {error}): {message}")
        self.device = device
        self.status = status
        self.error = error


class DeployError(CoordinatorError):
    """A deployment could not be planned, split, pushed or health-checked."""


class RollbackError(CoordinatorError):
    """There is no earlier version that can be switched back to."""


class RequestError(CoordinatorError):
    """An inference request is malformed: wrong names, shapes, types or encoding."""


class UnknownModelError(RequestError):
    """No deployment serves the requested model id."""


class NotServableError(CoordinatorError):
    """The model is known but cannot be served now (no live version, chain broken)."""
