"""Errors raised by the partitioner::

PartitionerError
├── InfeasiblePlanError   no arrangement of the devices holds the model
├── GraphError            the ONNX model cannot be loaded or analysed
│   └── UncostableOperatorError  an operator the partitioner cannot size
└── VerificationError     the chained segments do not reproduce the whole model
"""

from __future__ import annotations


class PartitionerError(Exception):
    """Base class of every error raised by :mod:`partitioner`."""


class InfeasiblePlanError(PartitionerError):
    """No device selection, order and cuts fit every stage into its device's memory.

    ``shortfall_bytes`` is by how many bytes the best arrangement falls short: the least,
    over all arrangements, of the largest amount by which a stage exceeds its device.
    """

    def __init__(self, message: str, shortfall_bytes: int) -> None:
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


class PlanningInputError(PartitionerError, ValueError):
    """The problem is valid but outside what the planner can handle exactly (sizes too large)."""


class GraphError(PartitionerError):
    """The ONNX model cannot be loaded, analysed or cut."""


class CalibrationError(GraphError):
    """The per-unit segments could not be timed (a segment failed to load or run)."""


class VerificationError(PartitionerError):
    """Running the segments as a chain does not reproduce the whole model's outputs."""

    def __init__(self, message: str, max_abs_diff: float) -> None:
        super().__init__(message)
        self.max_abs_diff = max_abs_diff


class UncostableOperatorError(GraphError):
    """A node's operator has no schema and no shape rule, so its tensors cannot be sized.

    Planning on a guess could put a stage on a device it does not fit; the partitioner stops
    instead, naming the operator (``domain``, ``op_type``) and the node (``node``).
    """

    def __init__(self, domain: str, op_type: str, node: str) -> None:
        qualified = f"{domain}::{op_type}" if domain else op_type
        super().__init__(
            f"cannot cost operator {qualified} (node {node!r}): ONNX has no schema for it and "
            "the partitioner has no shape rule, so its outputs cannot be sized"
        )
        self.domain, self.op_type, self.node = domain, op_type, node
