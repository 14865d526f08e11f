"""Errors raised by the agent's federated fine-tuning (part of :mod:`edge_agent.errors`)::

AgentError
└── TrainingError              federated fine-tuning on this device failed
    ├── TrainDataError         the training data directory is missing or malformed
    ├── UnsupportedOpError     a trainable segment uses an op the torch rebuild lacks
    ├── PlanMismatchError      the server's plan does not match the local segments
    └── SuperNodeError         the flower-supernode process could not start or died
"""

from __future__ import annotations

from edge_agent.errors import AgentError


class TrainingError(AgentError):
    """Base class of the agent's federated fine-tuning errors."""


class TrainDataError(TrainingError):
    """The training data directory is missing, unreadable or not ``x``/``y`` arrays."""


class UnsupportedOpError(TrainingError):
    """A segment to be trained uses an ONNX op that :mod:`.onnx_torch` cannot rebuild."""


class PlanMismatchError(TrainingError):
    """The server's train plan names segments or weights this device does not have."""


class SuperNodeError(TrainingError):
    """The ``flower-supernode`` process could not be started or exited unexpectedly."""
