"""Errors raised by federated fine-tuning on the coordinator::

CoordinatorError
└── TrainingError            federated fine-tuning failed
    ├── FlowerProcessError   flower-superlink or flwr run could not start or stopped early
    ├── TrainingRunError     the run ended without a complete metrics record
    ├── SegmentError         a segment cannot be cut, read or rewritten
    ├── RolloutError         a new version cannot be written
    ├── RunConflictError     a training run is already going (one at a time)
    ├── UnknownRunError      no training run has that id
    ├── NoTrainingTargetError  no training target is configured (409)
    └── LoraTargetError      the named model cannot be fine-tuned with LoRA (400)
"""

from __future__ import annotations

from coordinator.errors import CoordinatorError


class TrainingError(CoordinatorError):
    """Base class of every federated fine-tuning error on the coordinator."""


class FlowerProcessError(TrainingError):
    """A Flower process (SuperLink, ``flwr run``) failed to start or died."""


class TrainingRunError(TrainingError):
    """The training run did not complete (timeout, failed round, missing record)."""


class DivergedError(TrainingRunError):
    """A run's final adapters are not finite: the training diverged; nothing is rolled out."""


class SegmentError(TrainingError):
    """An ONNX segment cannot be cut, read or rewritten."""


class RolloutError(TrainingError):
    """A new segment version cannot be produced."""


class RunConflictError(TrainingError):
    """Another training run is still going; runs go one at a time."""


class UnknownRunError(TrainingError):
    """No training run has the given id."""


class NoTrainingTargetError(TrainingError):
    """No training target is configured: the coordinator has nothing to fine-tune."""


class LoraTargetError(TrainingError):
    """The named served model cannot be fine-tuned with LoRA (not a fedshard decoder export,
    a layer it does not have, an unknown target module)."""
