"""Errors raised by the agent's federated fine-tuning (part of :mod:`edge_agent.errors`)::

AgentError
└── TrainingError              federated fine-tuning on this device failed
    ├── TrainDataError         the training data directory is missing or malformed
    │   ├── EmptyDataError     the directory holds no records (or none left to train on)
    │   ├── MalformedRecordError   a record is not valid JSON of a known shape
    │   └── OneClassDataError  every record (or label) is the same: nothing to learn from
    ├── UnsupportedOpError     a trainable segment uses an op the torch rebuild lacks
    ├── PlanMismatchError      the server's plan does not match the local segments
    ├── SuperNodeError         the flower-supernode process could not start or died
    └── PrivacyError           a round would break this device's privacy rules
        ├── DpSeedError        a DP round was given a fixed seed
        ├── LedgerError        the privacy ledger is unreadable
        ├── ClearReleaseError  a DP run asked for the held-out evaluation in clear
        └── RoundDeclinedError the device declines the round (budget, no DP, no SecAgg+)
"""

from __future__ import annotations

from edge_agent.errors import AgentError
from protocols.ledger import DeclineReason


class TrainingError(AgentError):
    """Base class of the agent's federated fine-tuning errors."""


class TrainDataError(TrainingError):
    """The training data directory is missing, unreadable or not ``x``/``y`` arrays."""


class EmptyDataError(TrainDataError):
    """The training data directory holds no records, or none outside the held-out share."""


class MalformedRecordError(TrainDataError):
    """A record is not valid JSON, or not a chat, text or pair record; names file and line."""


class OneClassDataError(TrainDataError):
    """Every record (or every label) is the same, so training has nothing to learn."""


class UnsupportedOpError(TrainingError):
    """A segment to be trained uses an ONNX op that :mod:`.onnx_torch` cannot rebuild."""


class PlanMismatchError(TrainingError):
    """The server's train plan names segments or weights this device does not have."""


class SuperNodeError(TrainingError):
    """The ``flower-supernode`` process could not be started or exited unexpectedly."""


class PrivacyError(TrainingError):
    """A round would break this device's privacy rules (its DP randomness or its budget)."""


class DpSeedError(PrivacyError):
    """A DP round was given a fixed seed: its sampling and noise must come from ``os.urandom``
    (a seed anyone else knows, or can guess, lets them predict, and so remove, the noise)."""


class LedgerError(PrivacyError):
    """The device's privacy ledger is unreadable or malformed (a round is declined until the
    operator repairs it: a ledger that cannot be read cannot show the budget is kept)."""


class ClearReleaseError(PrivacyError):
    """A run under DP asked this device for a held-out evaluation in clear: under DP the
    evaluation leaves only inside the SecAgg+ vector (the evaluate-only fit round,
    :data:`protocols.lora.EVALUATE_ONLY_KEY`), so the request is refused."""


class RoundDeclinedError(PrivacyError):
    """This device declines the round; :attr:`reason` says why (a typed reason code)."""

    def __init__(self, reason: DeclineReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
